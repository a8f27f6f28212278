"""`gateway start`: serve OpenAI's API over HTTP as one asyncio client of the broker, until SIGTERM or SIGINT.

    gateway start --broker tcp://HOST:5555 --host 127.0.0.1 --port 8000 [--api-keys FILE] [--processes N]

Every flag falls back to an environment variable (GATEWAY_<FLAG>). SIGTERM or SIGINT: stop taking connections,
let the answers in flight finish (at most --drain-timeout seconds), close the sessions the gateway keeps, exit.
SIGHUP reads the API key file again. With --processes N, N processes share the port (each its own client of the
broker and its own sessions: a conversation is resumed when its requests reach the same process, e.g. on one
kept-alive connection); their metrics are summed.

Exit codes: 0 after a clean stop, 1 when a process of several failed, 2 for bad arguments, 3 when the gateway
cannot start (the port is taken, a key file is unreadable or malformed).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from broker.common import keys as curve_keys
from broker.common import logs
from broker.common.arguments import (
    env,
    from_env,
    non_negative_float,
    non_negative_int,
    one_of,
    port,
    positive_float,
    positive_int,
    zmq_address,
)
from client.gateway.reasoning import PARSERS
from client.gateway.tool_calls import PARSERS as TOOL_PARSERS

EXIT_FAILED = 1
EXIT_STARTUP_FAILED = 3
DEFAULT_BROKER = "tcp://127.0.0.1:5555"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="gateway", description="An OpenAI-compatible HTTP API in front of the broker.")
    sub = top.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="serve in the foreground")
    start.add_argument("--broker", type=zmq_address, default=env("GATEWAY_BROKER", DEFAULT_BROKER),
                       help="the broker's client address [env GATEWAY_BROKER] (default %(default)s)")
    start.add_argument("--host", default=env("GATEWAY_HOST", "127.0.0.1"),
                       help="interface to listen on [env GATEWAY_HOST] (default %(default)s)")
    start.add_argument("--port", type=port, default=from_env("GATEWAY_PORT", 8000),
                       help="HTTP port [env GATEWAY_PORT] (default %(default)s)")
    start.add_argument("--api-keys", type=Path, default=env("GATEWAY_API_KEYS", None),
                       help="file of API keys, `NAME KEY` a line; requests must send `Authorization: Bearer KEY` "
                            "[env GATEWAY_API_KEYS] (default: no keys, every request served)")
    start.add_argument("--broker-key", default=env("GATEWAY_BROKER_KEY", None),
                       help="a broker with --keys: its public key file [env GATEWAY_BROKER_KEY]")
    start.add_argument("--key", default=env("GATEWAY_KEY", None),
                       help="a broker with --keys: the gateway's client key pair, NAME.key_secret [env GATEWAY_KEY]")
    start.add_argument("--timeout", type=positive_float, default=from_env("GATEWAY_TIMEOUT", 60),
                       help="seconds to wait for each answer or streamed token from the broker [env GATEWAY_TIMEOUT] "
                            "(default %(default)s)")
    start.add_argument("--max-idle-sessions", type=non_negative_int, default=from_env("GATEWAY_MAX_IDLE_SESSIONS", 0),
                       help="idle sessions kept for the next turn, 0 for as many as the workers have slots for "
                            "(the least recently used closes first) [env GATEWAY_MAX_IDLE_SESSIONS] (default %(default)s)")
    start.add_argument("--reasoning-parser", type=one_of(*PARSERS), choices=PARSERS,
                       default=env("GATEWAY_REASONING_PARSER", None),
                       help="split a reasoning model's chat answers into `reasoning` and `content`, as vLLM's parser "
                            "of that name: qwen3 (Qwen3, Qwen3.5, QwQ) or deepseek_r1 (DeepSeek-R1 and its distills) "
                            "[env GATEWAY_REASONING_PARSER] (default: none, answers are content alone)")
    start.add_argument("--tool-call-parser", type=one_of(*TOOL_PARSERS), choices=TOOL_PARSERS,
                       default=env("GATEWAY_TOOL_CALL_PARSER", None),
                       help="take `tools` and read the function calls in chat answers, as vLLM's parser of that name: "
                            "hermes (Qwen2.5, Qwen3), qwen3_coder (Qwen3.5, Qwen3-Coder) or llama3_json (Llama 3.1, "
                            "3.2) "
                            "[env GATEWAY_TOOL_CALL_PARSER] (default: none, tools are refused)")
    start.add_argument("--processes", type=positive_int, default=from_env("GATEWAY_PROCESSES", 1),
                       help="processes sharing the port [env GATEWAY_PROCESSES] (default %(default)s)")
    start.add_argument("--drain-timeout", type=non_negative_float, default=from_env("GATEWAY_DRAIN_TIMEOUT", 30),
                       help="seconds the answers in flight get to finish after SIGTERM [env GATEWAY_DRAIN_TIMEOUT] "
                            "(default %(default)s)")
    start.add_argument("--log-level", type=one_of(*logs.LEVELS), choices=logs.LEVELS,
                       default=env("GATEWAY_LOG_LEVEL", "info"),
                       help="[env GATEWAY_LOG_LEVEL] (default %(default)s)")
    return top


def bind(host: str, port_number: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port_number))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port_number}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.log_level, role="gateway")
    log = structlog.get_logger()
    try:
        _keys(args)
        curve_keys.CurveClient.from_files(args.broker_key, args.key)
        sock = bind(args.host, args.port)
    except (OSError, ValueError, curve_keys.KeyFileError) as e:
        log.error("gateway_start_failed", error=str(e))
        return EXIT_STARTUP_FAILED
    log.info("gateway_listening", url=f"http://{args.host}:{sock.getsockname()[1]}", broker=args.broker,
             processes=args.processes, api_keys=str(args.api_keys) if args.api_keys else None)
    if args.processes == 1:
        return serve(args, sock)
    return supervise(args, sock)


def _keys(args: argparse.Namespace) -> Any:
    from client.gateway.auth import ApiKeys

    return ApiKeys.from_file(args.api_keys) if args.api_keys is not None else ApiKeys.open()


def serve(args: argparse.Namespace, sock: socket.socket) -> int:
    """One process: uvicorn on the bound socket until a signal."""
    import uvicorn

    from client.gateway.app import GatewayConfig, create_app

    log = structlog.get_logger()
    config = GatewayConfig(broker=args.broker, timeout=args.timeout, broker_key=args.broker_key, key=args.key,
                           api_keys=_keys(args), max_idle_sessions=args.max_idle_sessions,
                           reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)
    app = create_app(config)
    gateway = app.state.gateway

    def reload_keys() -> None:
        try:
            gateway.keys = _keys(args)
            log.info("api_keys_reloaded", keys=len(gateway.keys))
        except ValueError as e:
            log.error("api_keys_reload_failed", error=str(e))

    server = uvicorn.Server(uvicorn.Config(
        app, loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11", lifespan="on", log_config=None,
        access_log=False, log_level="warning", timeout_graceful_shutdown=math.ceil(args.drain_timeout),
        server_header=False))

    async def run() -> None:
        if hasattr(signal, "SIGHUP"):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_keys)
        await server.serve(sockets=[sock])

    # uvicorn takes SIGTERM and SIGINT while it serves, then raises the signal again for the handler it found: a
    # handler that does nothing, so that a clean stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    loop = _new_loop()
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(run())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
        sock.close()
    return 0 if server.started else EXIT_STARTUP_FAILED


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed, else asyncio's."""
    if importlib.util.find_spec("uvloop"):
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def supervise(args: argparse.Namespace, sock: socket.socket) -> int:
    """N processes sharing the socket; SIGTERM or SIGINT is passed on; their metrics summed in a shared folder."""
    log = structlog.get_logger()
    metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(args, sock, i), name=f"gateway-{i}") for i in range(args.processes)]
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM if signum != signal.SIGHUP else signal.SIGHUP)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    try:
        for proc in procs:
            proc.start()
        sock.close()
        code = 0
        while any(p.is_alive() for p in procs):
            for proc in procs:
                proc.join(timeout=0.2)
                if proc.exitcode not in (None, 0) and not stopping:
                    log.error("gateway_process_failed", process=proc.name, code=proc.exitcode)
                    code = EXIT_FAILED
                    on_signal(signal.SIGTERM, None)
        return code
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _child(args: argparse.Namespace, sock: socket.socket, index: int) -> None:
    logs.configure(args.log_level, role="gateway", process=index)
    sys.exit(serve(args, sock))


if __name__ == "__main__":
    sys.exit(main())
