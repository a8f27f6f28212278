"""`broker start`: run the broker until SIGTERM or SIGINT. Every flag falls back to an environment variable.

Exit codes: 0 after a clean shutdown, 2 for bad arguments, 3 when the broker cannot start (e.g. an
address is already in use).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

import structlog

from . import logs
from .server import BrokerConfig, BrokerServer

EXIT_STARTUP_FAILED = 3


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"broker: {name}={value!r} is not an integer") from None


def positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def parser() -> argparse.ArgumentParser:
    defaults = BrokerConfig()
    top = argparse.ArgumentParser(prog="broker", description="Route sessions between clients and workers.")
    sub = top.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run the broker in the foreground")
    start.add_argument("--clients", default=os.environ.get("BROKER_CLIENTS", defaults.clients),
                       help="address clients connect to [env BROKER_CLIENTS] (default %(default)s)")
    start.add_argument("--workers", default=os.environ.get("BROKER_WORKERS", defaults.workers),
                       help="address workers connect to [env BROKER_WORKERS] (default %(default)s)")
    start.add_argument("--heartbeat-ms", type=positive, default=_env_int("BROKER_HEARTBEAT_MS", defaults.heartbeat_ms),
                       help="heartbeat interval sent to workers [env BROKER_HEARTBEAT_MS] (default %(default)s)")
    start.add_argument("--liveness", type=positive, default=_env_int("BROKER_LIVENESS", defaults.liveness),
                       help="missed heartbeats before a worker is dead [env BROKER_LIVENESS] (default %(default)s)")
    start.add_argument("--recovery-ms", type=positive, default=_env_int("BROKER_RECOVERY_MS", None),
                       help="after a start, how long requests for unknown sessions wait for workers to "
                            "re-register [env BROKER_RECOVERY_MS] (default: liveness + 2 heartbeats)")
    start.add_argument("--hwm", type=positive, default=_env_int("BROKER_HWM", defaults.hwm),
                       help="messages queued per peer [env BROKER_HWM] (default %(default)s)")
    start.add_argument("--log-level", choices=logs.LEVELS, default=os.environ.get("BROKER_LOG_LEVEL", "info"),
                       help="[env BROKER_LOG_LEVEL] (default %(default)s)")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.log_level, role="broker")
    log = structlog.get_logger()
    config = BrokerConfig(
        clients=args.clients, workers=args.workers, heartbeat_ms=args.heartbeat_ms, liveness=args.liveness,
        recovery_ms=args.recovery_ms, hwm=args.hwm,
    )
    stop = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        server = BrokerServer(config)
    except OSError as e:
        log.error("broker_start_failed", error=str(e))
        return EXIT_STARTUP_FAILED
    try:
        server.serve(lambda: stop)
    finally:
        server.close()
    log.info("broker_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
