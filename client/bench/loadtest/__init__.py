"""The load-test harness (`loadtest`, `python -m client.bench.loadtest`): a tool on top of the client, not part of it.

    cli.py       LoadConfig, run() and the command line
    workload.py  what each simulated user does (turns, forks, rollovers), as a script of steps
    stack.py     the full-stack driver: users on AsyncClients in one or several client processes
    engine.py    the in-process driver: the same users on worker.engine.Engine (no broker)
    http.py      the HTTP driver: the same users through the gateway's OpenAI API
    interrupt.py stopping a run early: Ctrl-C or SIGTERM, or a stop flag given to run()
    progress.py  the live progress bar
    stats.py     raw samples and their statistics (TTFT, ITL, TPOT, end-to-end latency)
    report.py    the report under vLLM `bench serve` names, and its table
    plot.py      latency distributions and tokens/s over time (matplotlib)
"""

from client.bench.loadtest.cli import LoadConfig, main, run
from client.bench.loadtest.report import Report
from client.bench.loadtest.stack import LoadTestError

__all__ = ["LoadConfig", "LoadTestError", "Report", "main", "run"]
