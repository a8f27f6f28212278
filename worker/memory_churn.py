"""`python -m worker.memory_churn` moved to `python -m worker.bench.memory_churn`; this alias goes in the next release."""

from worker.bench.memory_churn import main

if __name__ == "__main__":
    main()
