"""`broker start`: run the broker until SIGTERM or SIGINT (SIGHUP re-reads the allowed keys).
`broker keygen DIR NAME`: make a CURVE key pair. `broker status`, `broker sessions`, `broker close-session ID`,
`broker drain WORKER`, `broker rebalance`: ask a running broker (broker/status_cmd.py, broker/sessions_cmd.py,
broker/moves_cmd.py). Every flag of `start` falls back to an environment
variable.

Exit codes: 0 after a clean shutdown, 2 for bad arguments (e.g. an address that is not tcp://HOST:PORT), 3
when the broker cannot start (e.g. an address is already in use, a key directory is incomplete, or its secret
key is readable by others).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import structlog

from broker import moves_cmd, sessions_cmd, status_cmd
from broker.admission import MAX_WORKER_SESSIONS_FLAG
from broker.common import heap, keys, logs
from broker.common.arguments import C_INT_MAX, from_env, non_negative_int, one_of, port, positive_int, zmq_address
from broker.common.metrics_http import MetricsServer
from broker.metrics import MIN_WORKERS, BrokerMetrics
from broker.router import GRACE_FLAG, MAX_SESSIONS_FLAG
from broker.server import BrokerConfig, BrokerServer

EXIT_STARTUP_FAILED = 3


def parser() -> argparse.ArgumentParser:
    defaults = BrokerConfig()
    top = argparse.ArgumentParser(prog="broker", description="Route sessions between clients and workers.")
    sub = top.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run the broker in the foreground")
    start.add_argument("--clients", type=zmq_address, default=os.environ.get("BROKER_CLIENTS", defaults.clients),
                       help="address clients connect to [env BROKER_CLIENTS] (default %(default)s)")
    start.add_argument("--workers", type=zmq_address, default=os.environ.get("BROKER_WORKERS", defaults.workers),
                       help="address workers connect to [env BROKER_WORKERS] (default %(default)s)")
    start.add_argument("--heartbeat-ms", type=positive_int, default=from_env("BROKER_HEARTBEAT_MS", defaults.heartbeat_ms),
                       help="heartbeat interval sent to workers [env BROKER_HEARTBEAT_MS] (default %(default)s)")
    start.add_argument("--liveness", type=positive_int, default=from_env("BROKER_LIVENESS", defaults.liveness),
                       help="missed heartbeats before a worker is dead [env BROKER_LIVENESS] (default %(default)s)")
    start.add_argument("--recovery-ms", type=positive_int, default=from_env("BROKER_RECOVERY_MS", None),
                       help="after a start, how long requests for unknown sessions wait for workers to "
                            "re-register (longer while a worker heard from has not) [env BROKER_RECOVERY_MS] "
                            "(default: liveness + 2 heartbeats, at least 2000)")
    start.add_argument("--worker-silence-ms", type=positive_int,
                       default=from_env("BROKER_WORKER_SILENCE_MS", defaults.worker_silence_ms),
                       help="a worker whose connection is up but that sends nothing this long is gone (a stopped or "
                            "cut-off one is noticed in liveness heartbeats) [env BROKER_WORKER_SILENCE_MS] "
                            "(default %(default)s)")
    start.add_argument(MAX_WORKER_SESSIONS_FLAG, type=positive_int,
                       default=from_env("BROKER_MAX_WORKER_SESSIONS", defaults.max_worker_sessions),
                       help="session slots one worker may register (a READY offering more is refused) "
                            "[env BROKER_MAX_WORKER_SESSIONS] (default %(default)s)")
    start.add_argument(GRACE_FLAG, type=non_negative_int,
                       default=from_env("BROKER_SESSION_GRACE_MS", defaults.session_grace_ms),
                       help="close a session once the client connection that last used it has been gone this long, "
                            "0 for never [env BROKER_SESSION_GRACE_MS] (default %(default)s)")
    start.add_argument("--client-grace-ms", type=non_negative_int,
                       default=from_env("BROKER_CLIENT_GRACE_MS", defaults.client_grace_ms),
                       help="a client the broker cannot reach (its connection closed: a paused process, a lost host) "
                            "has this long to come back, resuming its streams, before its generations are stopped; 0 "
                            "stops them at the next heartbeat [env BROKER_CLIENT_GRACE_MS] (default %(default)s)")
    start.add_argument("--io-threads", type=positive_int,
                       default=from_env("BROKER_IO_THREADS", defaults.io_threads),
                       help="ZeroMQ I/O threads (more move more bytes: session moves are relayed through the broker) "
                            "[env BROKER_IO_THREADS] (default %(default)s)")
    start.add_argument("--moves-per-worker", type=positive_int,
                       default=from_env("BROKER_MOVES_PER_WORKER", defaults.moves_per_worker),
                       help="session moves running at once from one worker in a drain or rebalance "
                            "[env BROKER_MOVES_PER_WORKER] (default %(default)s)")
    start.add_argument("--hwm", type=positive_int, default=from_env("BROKER_HWM", defaults.hwm),
                       help="messages queued per peer [env BROKER_HWM] (default %(default)s)")
    start.add_argument("--keys", type=Path, default=os.environ.get("BROKER_KEYS") or None,
                       help="turn CURVE authentication on: DIR/broker.key_secret, DIR/workers/*.key and "
                            "DIR/clients/*.key (see `broker keygen`) [env BROKER_KEYS] (default: off)")
    start.add_argument(MAX_SESSIONS_FLAG, type=non_negative_int,
                       default=from_env("BROKER_MAX_SESSIONS_PER_CLIENT", defaults.max_sessions_per_client),
                       help="live sessions one client may hold, 0 for no cap [env BROKER_MAX_SESSIONS_PER_CLIENT] "
                            "(default %(default)s)")
    start.add_argument("--request-timeout-ms", type=non_negative_int,
                       default=from_env("BROKER_REQUEST_TIMEOUT_MS", defaults.request_timeout_ms),
                       help="fail a request with `timeout` when nothing of it reaches its client (an answer, streamed "
                            "tokens) for this long, 0 for never [env BROKER_REQUEST_TIMEOUT_MS] (default %(default)s)")
    start.add_argument("--log-level", type=one_of(*logs.LEVELS), choices=logs.LEVELS,
                       default=from_env("BROKER_LOG_LEVEL", "info"),
                       help="[env BROKER_LOG_LEVEL] (default %(default)s)")
    start.add_argument("--metrics-port", type=port, default=from_env("BROKER_METRICS_PORT", None),
                       help="serve /metrics, /healthz and /readyz on this port [env BROKER_METRICS_PORT] (default: off)")
    start.add_argument("--metrics-host", default=os.environ.get("BROKER_METRICS_HOST") or "127.0.0.1",
                       help="interface of the metrics port [env BROKER_METRICS_HOST] (default %(default)s)")
    start.add_argument("--min-workers", type=non_negative_int, default=from_env("BROKER_MIN_WORKERS", MIN_WORKERS),
                       help="/readyz answers 503 while fewer workers take new sessions (registered, not draining); "
                            "0: ready without any [env BROKER_MIN_WORKERS] (default %(default)s)")
    status_cmd.add_parser(sub)
    sessions_cmd.add_parsers(sub)
    moves_cmd.add_parsers(sub)
    keygen = sub.add_parser("keygen", help="write a CURVE key pair: DIR/NAME.key (public), DIR/NAME.key_secret")
    keygen.add_argument("directory", type=Path, help="where to write (made if missing)")
    keygen.add_argument("name", help="the key's name, e.g. broker, a worker's or a client's name")
    return top


def run_keygen(args: argparse.Namespace) -> int:
    try:
        public, secret = keys.keygen(args.directory, args.name)
    except (keys.KeyFileError, OSError) as e:
        sys.stderr.write(f"broker keygen: {e}\n")
        return 1
    sys.stdout.write(f"{public}\n{secret}\n")
    return 0


MAX_IO_THREADS = 64


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parser()
    args = arguments.parse_args(argv)
    if args.command == "start":
        if args.heartbeat_ms * args.liveness > C_INT_MAX:
            arguments.error(f"--heartbeat-ms x --liveness must be <= {C_INT_MAX} ms")
        if args.io_threads > MAX_IO_THREADS:
            arguments.error(f"argument --io-threads: must be <= {MAX_IO_THREADS}, got {args.io_threads}")
    if args.command == "keygen":
        return run_keygen(args)
    if args.command == "status":
        return status_cmd.run(args)
    if args.command == "sessions":
        return sessions_cmd.run_sessions(args)
    if args.command == "close-session":
        return sessions_cmd.run_close(args)
    if args.command in ("drain", "rebalance"):
        return moves_cmd.run(args)
    logs.configure(args.log_level, role="broker")
    log = structlog.get_logger()
    config = BrokerConfig(
        clients=args.clients, workers=args.workers, heartbeat_ms=args.heartbeat_ms, liveness=args.liveness,
        recovery_ms=args.recovery_ms, hwm=args.hwm, keys=args.keys, max_sessions_per_client=args.max_sessions_per_client,
        request_timeout_ms=args.request_timeout_ms, worker_silence_ms=args.worker_silence_ms,
        max_worker_sessions=args.max_worker_sessions, session_grace_ms=args.session_grace_ms,
        io_threads=args.io_threads, moves_per_worker=args.moves_per_worker, client_grace_ms=args.client_grace_ms,
    )
    stop = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    reload = False

    def request_reload(signum: int, frame: FrameType | None) -> None:
        nonlocal reload
        reload = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGHUP, request_reload)
    try:
        server = BrokerServer(config)
    except (OSError, keys.KeyFileError) as e:
        log.error("broker_start_failed", error=str(e))
        return EXIT_STARTUP_FAILED
    metrics_server: MetricsServer | None = None
    if args.metrics_port is not None:
        metrics = BrokerMetrics(server.router, server.router.counters, min_workers=args.min_workers)
        try:
            metrics_server = MetricsServer(metrics.registry, args.metrics_host, args.metrics_port,
                                           alive=server.pulse.alive, ready=metrics.readiness).start()
        except OSError as e:
            log.error("broker_start_failed", error=str(e))
            server.close()
            return EXIT_STARTUP_FAILED

    def should_stop() -> bool:
        nonlocal reload
        if reload:
            reload = False
            try:
                server.reload_keys()
            except (keys.KeyFileError, OSError) as e:  # the allow-lists in force stay
                log.error("keys_reload_failed", error=str(e))
        return stop

    heap.settle()
    try:
        server.serve(should_stop)
    finally:
        if metrics_server is not None:
            metrics_server.close()
        server.close()
    log.info("broker_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
