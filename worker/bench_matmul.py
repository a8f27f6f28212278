"""`python -m worker.bench_matmul` moved to `python -m worker.bench.matmul`; this alias goes in the next release."""

from worker.bench.matmul import main

if __name__ == "__main__":
    main()
