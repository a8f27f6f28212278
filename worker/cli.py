"""`worker start`: load the model once, register with the broker, serve until SIGTERM/SIGINT drains it.

Every flag falls back to an environment variable. Exit codes: 0 after a clean drain, 1 when the engine
failed while serving, 2 for bad arguments (checked before the model loads: e.g. a --broker that is not
tcp://HOST:PORT), 3 when the model or device cannot be loaded.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from types import FrameType

import structlog

from broker.common import heap, logs
from broker.common import protocol as p
from broker.common.arguments import (
    env,
    from_env,
    non_negative_float,
    non_negative_int,
    one_of,
    port,
    positive_int,
    zmq_address,
)
from broker.common.keys import CurveClient, KeyFileError
from broker.common.metrics_http import MetricsServer
from worker.model.config import ModelLoadError
from worker.serve.generation_config import sampling_defaults
from worker.serve.loop import Serve, WorkerConfig
from worker.serve.metrics import WorkerMetrics, worker_readiness

EXIT_STARTUP_FAILED = 3
WAITING_LOG_S = 5.0  # a worker that has not reached its broker says so this often


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), the default of --threads."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def device(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")


def parser() -> argparse.ArgumentParser:
    defaults = WorkerConfig()
    top = argparse.ArgumentParser(prog="worker", description="Serve one model's sessions for a broker.")
    sub = top.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="run a worker in the foreground")
    start.add_argument("--broker", type=zmq_address, default=env("WORKER_BROKER", defaults.broker),
                       help="the broker's worker address [env WORKER_BROKER] (default %(default)s)")
    start.add_argument("--model", default=env("WORKER_MODEL", None),
                       help="a .gguf file, a Hugging Face folder, or random:PRESET[:SEED] (e.g. random:tiny) "
                            "[env WORKER_MODEL] (default: the bundled SmolLM2-135M-Instruct)")
    start.add_argument("--generation-config", default=env("WORKER_GENERATION_CONFIG", "auto"), metavar="SOURCE",
                       help="the model's recommended sampling, which the OpenAI gateway gives requests that leave a "
                            "parameter out: auto (the model folder's generation_config.json, if any), none, or the "
                            "path of a generation_config.json or its folder [env WORKER_GENERATION_CONFIG] "
                            "(default %(default)s)")
    start.add_argument("--device", type=device, default=env("WORKER_DEVICE", "auto"),
                       help="auto, cpu, cuda or cuda:N [env WORKER_DEVICE] (default %(default)s)")
    start.add_argument("--max-sessions", type=positive_int, default=from_env("WORKER_MAX_SESSIONS", 8),
                       help="session slots (virtual: memory is held by the sessions' tokens, see --state-pages) "
                            "[env WORKER_MAX_SESSIONS] (default %(default)s)")
    start.add_argument("--max-context", type=positive_int, default=from_env("WORKER_MAX_CONTEXT", 2048),
                       help="tokens per session [env WORKER_MAX_CONTEXT] (default %(default)s)")
    start.add_argument("--name", default=env("WORKER_NAME", f"{socket.gethostname()}-{os.getpid()}"),
                       help="shown in logs and status [env WORKER_NAME] (default HOST-PID)")
    start.add_argument("--drain-timeout", type=non_negative_float,
                       default=env("WORKER_DRAIN_TIMEOUT", str(defaults.drain_timeout_s)),
                       help="seconds in-flight generations get to finish after SIGTERM [env WORKER_DRAIN_TIMEOUT] "
                            "(default %(default)s)")
    start.add_argument("--threads", type=positive_int, default=from_env("WORKER_THREADS", usable_cores()),
                       help="torch's intra-op threads on the CPU [env WORKER_THREADS] (default: the cores this "
                            "process may run on, now %(default)s); on a host shared with other busy work, fewer")
    start.add_argument("--reconnect-max-ms", type=positive_int,
                       default=from_env("WORKER_RECONNECT_MAX_MS", defaults.reconnect_max_ms),
                       help="ceiling of the reconnect backoff [env WORKER_RECONNECT_MAX_MS] (default %(default)s)")
    start.add_argument("--broker-key", default=env("WORKER_BROKER_KEY", None),
                       help="the broker's public key file (broker.key), when it authenticates [env WORKER_BROKER_KEY]")
    start.add_argument("--key", default=env("WORKER_KEY", None),
                       help="this worker's key pair file (NAME.key_secret from `broker keygen`) [env WORKER_KEY]")
    start.add_argument("--session-idle-timeout", type=non_negative_float,
                       default=from_env("WORKER_SESSION_IDLE_TIMEOUT", 0),
                       help="close sessions idle (no request, no generation) longer than this many seconds; 0 for "
                            "never [env WORKER_SESSION_IDLE_TIMEOUT] (default %(default)s)")
    start.add_argument("--state-pages", type=non_negative_int, default=from_env("WORKER_STATE_PAGES", 0),
                       help="pages (of the 2 MiB allocation granularity) of session state all sessions may hold "
                            "together; 0 for as many as fit in free memory (every slot whole on the CPU) "
                            "[env WORKER_STATE_PAGES] (default %(default)s)")
    start.add_argument("--hibernate-after", type=non_negative_float,
                       default=from_env("WORKER_HIBERNATE_AFTER", 0),
                       help="move sessions idle longer than this many seconds out of device memory (to host memory, "
                            "then --session-store); 0 for only when pages run out [env WORKER_HIBERNATE_AFTER] "
                            "(default %(default)s)")
    start.add_argument("--host-cache-gb", type=non_negative_float,
                       default=from_env("WORKER_HOST_CACHE_GB", 0),
                       help="host memory for hibernated sessions' state, in GiB (pinned on a GPU); 0 and no "
                            "--session-store: sessions never hibernate [env WORKER_HOST_CACHE_GB] (default %(default)s)")
    start.add_argument("--session-store", default=env("WORKER_SESSION_STORE", None),
                       help="a directory for hibernated sessions (checksummed files); a clean stop (SIGTERM) writes "
                            "every session there and a worker started with it serves them again "
                            "[env WORKER_SESSION_STORE] (default: none)")
    start.add_argument("--metrics-port", type=port, default=from_env("WORKER_METRICS_PORT", None),
                       help="serve /metrics, /healthz and /readyz on this port [env WORKER_METRICS_PORT] (default: off)")
    start.add_argument("--metrics-host", default=env("WORKER_METRICS_HOST", "127.0.0.1"),
                       help="interface of the metrics port [env WORKER_METRICS_HOST] (default %(default)s)")
    start.add_argument("--log-level", type=one_of(*logs.LEVELS), choices=logs.LEVELS,
                       default=env("WORKER_LOG_LEVEL", "info"),
                       help="[env WORKER_LOG_LEVEL] (default %(default)s)")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parser()
    args = arguments.parse_args(argv)
    try:
        p.Ready(name=args.name, model="-", capacity=0, free_slots=0, max_context=0)
    except p.ProtocolError as e:
        arguments.error(f"argument --name: {e.message}")  # exits 2, as any bad argument
    logs.configure(args.log_level, role="worker", worker=args.name)
    log = structlog.get_logger()
    import torch  # here, not at the top: `worker --help` and bad arguments answer without loading torch

    torch.set_num_threads(args.threads)
    try:
        curve = CurveClient.from_files(args.broker_key, args.key)
    except KeyFileError as e:
        log.error("worker_start_failed", error=str(e))
        return EXIT_STARTUP_FAILED
    except ValueError as e:  # one of the two alone: a bad argument
        arguments.error(f"arguments --broker-key, --key: {e}")
    try:
        recommended = sampling_defaults(args.generation_config, args.model)
    except ModelLoadError as e:  # before the model's (slow) load
        log.error("worker_start_failed", error=str(e), error_type=type(e).__name__, model=args.model)
        return EXIT_STARTUP_FAILED
    if recommended.given():
        log.info("sampling_defaults", **recommended.given())
    config = WorkerConfig(
        broker=args.broker, name=args.name, drain_timeout_s=args.drain_timeout, reconnect_max_ms=args.reconnect_max_ms,
        curve=curve, session_idle_timeout_s=args.session_idle_timeout, metrics=args.metrics_port is not None,
        hibernate_after_s=args.hibernate_after, test_move_pause=move_pause_option(os.environ.get("WORKER_TEST_MOVE_PAUSE")),
        test_corrupt_moves=os.environ.get("WORKER_TEST_CORRUPT_MOVES") == "1", sampling_defaults=recommended,
    )
    serve: Serve | None = None
    stop_requested = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop_requested
        stop_requested = True
        if serve is not None:
            serve.drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        from worker.engine import Engine, SamplingParams

        engine = Engine.load(
            model=args.model, device=args.device, max_sessions=args.max_sessions, max_context=args.max_context,
            state_pages=args.state_pages or None, host_cache_bytes=int(args.host_cache_gb * 2**30),
            session_store=args.session_store,
        )
    except Exception as e:  # the startup edge: any load failure is reported and exits with its own code
        log.error("worker_start_failed", error=str(e), error_type=type(e).__name__, model=args.model)
        return EXIT_STARTUP_FAILED

    def sampling(s: p.Sampling) -> SamplingParams:
        return SamplingParams(
            max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
            stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, logprobs=s.logprobs,
            logit_bias=tuple((b.token, b.bias) for b in s.logit_bias), repetition_penalty=s.repetition_penalty,
            frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty, min_p=s.min_p,
            min_tokens=s.min_tokens,
        )

    serve = Serve(engine, config, sampling)
    if stop_requested:
        log.info("worker_stopped_before_serving")
        return 0
    metrics_server: MetricsServer | None = None
    if args.metrics_port is not None:
        served = serve

        def ready() -> tuple[bool, str]:
            return worker_readiness(served.link.registered.is_set(), served.draining)

        assert isinstance(serve.metrics, WorkerMetrics)  # config.metrics was set
        try:
            metrics_server = MetricsServer(serve.metrics.registry, args.metrics_host, args.metrics_port,
                                           alive=serve.pulse.alive, ready=ready).start()
        except OSError as e:
            log.error("worker_start_failed", error=str(e))
            return EXIT_STARTUP_FAILED
    heap.settle(heap.SWITCH_INTERVAL_S)  # the model is loaded and its graphs captured: freeze that heap
    log.info("worker_serving", broker=args.broker, model=engine.model_name, capacity=engine.capacity,
             threads=torch.get_num_threads())
    threading.Thread(target=announce_waiting, args=(serve.link.registered, args.broker), name="worker-waiting",
                     daemon=True).start()
    try:
        return serve.run()
    finally:
        if metrics_server is not None:
            metrics_server.close()


MOVE_STEPS = ("export", "release", "import")


def move_pause_option(value: str | None) -> tuple[str, float] | None:
    """WORKER_TEST_MOVE_PAUSE=STEP:SECONDS (tests only): where a move sleeps (see WorkerConfig.test_move_pause)."""
    if not value:
        return None
    step, _, seconds = value.partition(":")
    try:
        pause = float(seconds)
    except ValueError:
        pause = -1.0
    if step not in MOVE_STEPS or not 0 < pause <= 600:
        raise SystemExit(f"worker: WORKER_TEST_MOVE_PAUSE: expected one of {', '.join(MOVE_STEPS)}:SECONDS "
                         f"(0 < SECONDS <= 600), got {value!r}")
    return step, pause


def announce_waiting(registered: threading.Event, broker: str) -> None:
    """Until the worker first registers, say every WAITING_LOG_S that no broker has answered yet."""
    waited = 0.0
    while not registered.wait(WAITING_LOG_S):
        waited += WAITING_LOG_S
        log = structlog.get_logger()
        log.warning("waiting_for_broker", broker=broker, waited_s=waited,
                    hint="no broker has answered: is it running, and is this its worker address (broker start --workers)?")


if __name__ == "__main__":
    sys.exit(main())
