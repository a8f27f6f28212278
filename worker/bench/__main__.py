"""`python -m worker.bench`: CPU/GPU speed of the engine in-process: load time and decode tokens/s for 1 and N sessions."""

from worker.bench.engine import main

main()
