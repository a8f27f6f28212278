"""`client.loadtest` moved to `client.bench.loadtest` (the `loadtest` command is unchanged); this alias, for
`python -m client.loadtest` and `from client.loadtest import LoadConfig, run`, goes in the next release."""

import sys

from client.bench.loadtest import LoadConfig, LoadTestError, Report, main, run

__all__ = ["LoadConfig", "LoadTestError", "Report", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
