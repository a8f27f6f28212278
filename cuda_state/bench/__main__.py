"""`python -m cuda_state.bench`: Micro-benchmark of the GPU session table and decode: `python -m cuda_state.bench.table [--json PATH]`."""

from cuda_state.bench.table import main

main()
