"""`python -m client.bench.loadtest`: the `loadtest` command."""

import sys

from client.bench.loadtest.cli import main

if __name__ == "__main__":
    sys.exit(main())
