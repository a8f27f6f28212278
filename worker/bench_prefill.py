"""`python -m worker.bench_prefill` moved to `python -m worker.bench.prefill`; this alias goes in the next release."""

from worker.bench.prefill import main

if __name__ == "__main__":
    main()
