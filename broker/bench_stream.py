"""`python -m broker.bench_stream` moved to `python -m broker.bench.stream`; this alias goes in the next release."""

from broker.bench.stream import main

if __name__ == "__main__":
    main()
