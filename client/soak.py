"""`python -m client.soak` moved to `python -m client.bench.soak`; this alias goes in the next release."""

import sys

from client.bench.soak import main

if __name__ == "__main__":
    sys.exit(main())
