"""`python -m worker.step_profile` moved to `python -m worker.bench.step_profile`; this alias goes in the next release."""

from worker.bench.step_profile import main

if __name__ == "__main__":
    main()
