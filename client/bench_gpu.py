"""`python -m client.bench_gpu` moved to `python -m client.bench.gpu`; this alias goes in the next release."""

from client.bench.gpu import main

if __name__ == "__main__":
    main()
