"""`loadtest`: drive the serving stack (or the engine in-process) with concurrent multi-turn sessions.

    loadtest --broker tcp://127.0.0.1:5555 --sessions 64 --prompt-tokens 128 --max-tokens 256 \\
             --ignore-eos --requests 1024 --processes 4 --json out.json --plot out.png
    loadtest --in-process --model random:smollm2-135m --device cuda --sessions 64 ...
    loadtest --http http://127.0.0.1:8000 --sessions 64 ...         (through the gateway's OpenAI API)
    loadtest --http http://127.0.0.1:8000 --broker tcp://127.0.0.1:5555 --compare ...  (native, then HTTP)
    loadtest --http http://127.0.0.1:8000 --broker tcp://127.0.0.1:5555 --compare together ...  (both at once)

Each turn of a session appends a prompt of P tokens (seeded random token ids, or text from a seeded
word list) and generates M tokens streamed, in one request (`generate(prompt=...)`), for T turns;
every K-th turn it may fork, run one turn on the child and close it. A session whose next turn would
overflow the context is closed and a new one opened. The run lasts a number of generate requests or
a duration, then closes every session and reports vLLM `bench serve` figures: throughput, TTFT, ITL,
TPOT, end-to-end latency, session create/fork/close latency, failures by error code. A conversation's
first turn's TTFT counts from the request that opens its session (natively its CREATE; the gateway opens
the session within that turn), as its user waits for both.

The Python API (used by benchmark scripts):

    from client.bench.loadtest import LoadConfig, run
    report = run(LoadConfig(broker="tcp://127.0.0.1:5555", sessions=64, max_tokens=256, ignore_eos=True))
    print(report.output_tokens_per_s); report.to_dict(); report.table()

Ctrl-C (SIGINT) or SIGTERM stops the run: no new request, the turns in flight cut short, every session closed,
and the report of what was measured so far printed, marked INTERRUPTED (client.bench.loadtest.interrupt); a
second one quits at once, without a report.

Exit codes: 0 when the run finished with at least one completed request, 1 when none completed or the
run could not be carried out (no broker answering, a client process failed, the model did not load),
2 for bad arguments, 130 when stopped by SIGINT (143 by SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from broker.common.arguments import zmq_address
from client.bench.loadtest.interrupt import Stop, StopFlag, on_signals
from client.bench.loadtest.progress import ProgressView, Tally
from client.bench.loadtest.report import Report, build_report
from client.bench.loadtest.stack import LoadTestError
from client.bench.loadtest.stats import RawRun, merge
from client.bench.loadtest.workload import Budget, Workload
from client.errors import ClientError

if TYPE_CHECKING:
    from worker.engine import Engine

__all__ = ["LoadConfig", "LoadTestError", "Report", "main", "run"]

log = structlog.get_logger()

DEFAULT_BROKER = "tcp://127.0.0.1:5555"
PROMPT_KINDS = ("tokens", "text")
WARMUP_SEED = 1 << 40  # added to the seed for warm-up prompts
MAX_TEMPERATURE = 100.0  # the engine's SamplingParams limit
REACH_TIMEOUT_S = 5.0  # how long the broker gets to answer a STATUS before the run starts


@dataclass(frozen=True)
class LoadConfig:
    """One load test. Stores values only; `run()` checks them (`validate()`) and does the work."""

    broker: str | None = DEFAULT_BROKER  # the broker's client address (full-stack mode)
    in_process: bool = False  # drive worker.engine.Engine directly instead of the stack
    model: str | None = None  # full stack: the model name for placement (None: any worker);
    #                           in-process: a .gguf / HF folder / random:PRESET (None: the bundled SmolLM2)
    device: str = "auto"  # in-process only
    sessions: int = 8  # concurrent sessions (simulated users)
    prompt_tokens: int = 128  # P: prompt tokens per turn
    max_tokens: int = 128  # M: tokens generated per turn
    turns: int = 4  # T: turns per conversation before the session is closed and a new one opened
    requests: int | None = None  # generate requests in total (None with no duration: sessions * turns)
    duration: float | None = None  # seconds during which new requests start
    ignore_eos: bool = False  # fixed-length generations (benchmarks)
    temperature: float = 0.0
    seed: int = 0
    processes: int = 1  # client processes the sessions are split over (full stack)
    fork_every: int = 0  # K: fork every K-th turn and run one turn on the child (0: never)
    prompt_kind: str = "tokens"  # "tokens" (random ids) or "text" (random words)
    max_context: int = 2048  # a session is rolled over before a turn would pass this
    progress: bool = False  # the live progress bar (stderr)
    timeout: float = 60.0  # seconds to wait for each answer or streamed chunk
    vocab_size: int = 256  # token-id prompts draw from [0, vocab_size); 256 is valid for every model here
    warmup: int = 0  # generate requests run first and not measured (compilation, CUDA-graph capture)
    broker_key: str | None = None  # a broker with --keys: its public key file ...
    key: str | None = None  # ... and this client's key pair file (NAME.key_secret)
    http: str | None = None  # the gateway's URL: drive its OpenAI API (client.bench.loadtest.http) instead
    api_key: str | None = None  # the gateway's API key (with --http)

    def validate(self) -> None:
        """Raise ValueError naming the first bad value."""
        positive = ("sessions", "prompt_tokens", "max_tokens", "turns", "processes", "max_context", "vocab_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration is not None and not (0 < self.duration < math.inf):  # nan and inf: a run that never ends
            raise ValueError(f"duration must be a number of seconds > 0, got {self.duration}")
        if self.fork_every < 0 or self.warmup < 0:
            raise ValueError(f"fork_every and warmup must be >= 0, got {self.fork_every} and {self.warmup}")
        if self.prompt_kind not in PROMPT_KINDS:
            raise ValueError(f"prompt_kind must be one of {', '.join(PROMPT_KINDS)}, got {self.prompt_kind!r}")
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"timeout must be a number of seconds > 0, got {self.timeout}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # else every request would fail bad_request
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.in_process and self.processes > 1:
            raise ValueError("in-process mode runs in one process: leave processes at 1")
        if not self.in_process and not self.broker and not self.http:
            raise ValueError("give a broker address, a gateway URL (http), or in_process=True")
        if (self.broker_key is None) != (self.key is None):
            raise ValueError("give both broker_key and key, or neither")
        if self.http is not None:
            if self.in_process:
                raise ValueError("--http drives the gateway: leave out --in-process")
            if self.fork_every:
                raise ValueError("the OpenAI API has no fork: leave fork_every at 0 with --http")
            if not self.http.startswith("http://"):
                raise ValueError(f"--http takes http://HOST:PORT, got {self.http!r}")
        if self.workload().prompt_room + self.max_tokens > self.max_context:
            raise ValueError(f"one turn ({self.prompt_tokens} prompt + {self.max_tokens} generated tokens) "
                             f"does not fit max_context {self.max_context}")

    @property
    def request_limit(self) -> int | None:
        """Requests to run: --requests, none with --duration, else one conversation a session (its turns, and with
        --fork-every the forked turns, each one request)."""
        if self.requests is not None or self.duration is not None:
            return self.requests
        forked = self.turns // self.fork_every if self.fork_every else 0
        return self.sessions * (self.turns + forked)

    @property
    def mode(self) -> str:
        return "in-process" if self.in_process else "http" if self.http else "full-stack"

    def workload(self, warmup: bool = False) -> Workload:
        """What each user does; the warm-up draws other prompts (another seed) of the same shape."""
        return Workload(
            prompt_tokens=self.prompt_tokens, max_tokens=self.max_tokens, turns=self.turns, fork_every=self.fork_every,
            max_context=self.max_context, prompt_kind=self.prompt_kind, temperature=self.temperature,
            ignore_eos=self.ignore_eos, seed=self.seed + WARMUP_SEED if warmup else self.seed, vocab_size=self.vocab_size,
            conversations=1 if not warmup and self.requests is None and self.duration is None else None,
        )


def run(config: LoadConfig, *, engine: Engine | None = None, log_level: str = "warning",
        stop: StopFlag | None = None) -> Report:
    """Run the load test and report. In-process mode loads the engine (or uses `engine`, left open).

    `log_level`: what client processes (processes > 1) log at; this process logs as its caller configured.
    With processes > 1 the client processes are started with multiprocessing's spawn, which imports the
    calling script again: a script that calls run() needs the `if __name__ == "__main__":` guard.
    `stop` (e.g. a threading.Event, or interrupt.Stop that main() sets on Ctrl-C): once set, the run stops early,
    closes its sessions and reports what it measured, `interrupted`.
    """
    config.validate()
    if config.in_process:
        raw = _run_in_process(config, engine, stop)
    elif config.http:
        raw = _run_http(config, log_level, stop)
    else:
        raw = _run_stack(config, log_level, stop)
    report = build_report(raw, config.mode, asdict(config))
    log.info("loadtest_done", mode=config.mode, completed=report.completed, failed=report.failed,
             output_tokens_per_s=round(report.output_tokens_per_s, 1))
    return report


def _stopped(stop: StopFlag | None) -> bool:
    return stop is not None and stop.is_set()


def _not_started() -> RawRun:
    """The run of a load test stopped before its measured run began (in its warm-up): nothing measured."""
    now = time.perf_counter()
    return RawRun(start=now, finish=now, interrupted=True)


def _run_in_process(config: LoadConfig, engine: Engine | None, stop: StopFlag | None) -> RawRun:
    from client.bench.loadtest.engine import load_engine, run_in_process

    own = engine is None
    if engine is None:
        slots = config.sessions * (2 if config.fork_every else 1)  # a session and its fork child
        try:
            engine = load_engine(config.model, config.device, slots, config.max_context)
        except Exception as e:  # the start-up edge: whatever stops the model loading ends the run
            raise LoadTestError(f"cannot load model {config.model or '(bundled)'} on {config.device}: {e}") from e
    try:
        if config.warmup:
            warm = Budget(config.warmup, None)
            run_in_process(engine, config.workload(warmup=True), min(config.sessions, config.warmup), warm, Tally(),
                           _nothing, stop)
        if _stopped(stop):
            return _not_started()
        tally = Tally()
        with ProgressView(config.request_limit, config.duration, config.progress) as view:
            budget = Budget(config.request_limit, config.duration)
            raw = run_in_process(engine, config.workload(), config.sessions, budget, tally, lambda: view.update(tally),
                                 stop)
            view.update(tally)
        return raw
    finally:
        if own:
            engine.table.close()


def _check_broker(config: LoadConfig) -> None:
    """LoadTestError unless the broker answers a STATUS (its workers are logged)."""
    from client.sync import Client

    assert config.broker is not None  # validate() checked
    try:
        with Client(config.broker, timeout=min(config.timeout, REACH_TIMEOUT_S), broker_key=config.broker_key,
                    key=config.key) as client:
            workers = client.status()
    except ClientError as e:
        raise LoadTestError(f"no broker answers at {config.broker}: {e}") from e
    log.info("loadtest_workers", workers=[(w.name, w.model, w.capacity) for w in workers])


def _run_stack(config: LoadConfig, log_level: str, stop: StopFlag | None) -> RawRun:
    from client.bench.loadtest.stack import run_processes, split

    assert config.broker is not None  # validate() checked
    _check_broker(config)
    if config.warmup:
        warm = split(config.broker, config.model, config.timeout, config.workload(warmup=True), min(config.sessions, config.warmup),
                     1, config.warmup, None, config.broker_key, config.key)
        run_processes(warm, Tally(), _nothing, _nothing, stop=stop)
    if _stopped(stop):
        return _not_started()
    parts = split(config.broker, config.model, config.timeout, config.workload(), config.sessions, config.processes,
                  config.request_limit, config.duration, config.broker_key, config.key)
    tally = Tally()
    with ProgressView(config.request_limit, config.duration, config.progress) as view:
        raw = run_processes(parts, tally, view.started, lambda: view.update(tally), log_level, stop)
        view.update(tally)
    return raw


def _run_http(config: LoadConfig, log_level: str, stop: StopFlag | None) -> RawRun:
    from client.bench.loadtest.http import served_model
    from client.bench.loadtest.stack import run_processes, split

    assert config.http is not None
    model = config.model or served_model(config.http, config.api_key, min(config.timeout, REACH_TIMEOUT_S))
    def parts(workload: Workload, sessions: int, processes: int, requests: int | None,
              duration: float | None) -> list[Any]:
        return split("", model, config.timeout, workload, sessions, processes, requests, duration,
                     http=config.http, api_key=config.api_key)

    if config.warmup:
        run_processes(parts(config.workload(warmup=True), min(config.sessions, config.warmup), 1, config.warmup, None),
                      Tally(), _nothing, _nothing, stop=stop)
    if _stopped(stop):
        return _not_started()
    tally = Tally()
    with ProgressView(config.request_limit, config.duration, config.progress) as view:
        raw = run_processes(parts(config.workload(), config.sessions, config.processes, config.request_limit,
                                  config.duration), tally, view.started, lambda: view.update(tally), log_level, stop)
        view.update(tally)
    return raw


def validate_together(config: LoadConfig) -> None:
    """Raise ValueError unless `config` can be measured both ways at once (run_together)."""
    config.validate()
    if config.http is None or config.broker is None:
        raise ValueError("measuring together needs both a broker address and a gateway URL (http)")
    if config.sessions < 2 or config.processes < 2:
        raise ValueError("measuring together needs at least 2 sessions and 2 processes (one side each)")


def run_together(config: LoadConfig, log_level: str = "warning", stop: StopFlag | None = None) -> tuple[Report, Report]:
    """The native client and the gateway measured at once, on one engine: half the sessions (and processes and
    requests) through the broker, half through the gateway's OpenAI API, the same users' prompts on both sides, every
    process starting on one signal. Both see the same load at the same moments (the engine's steps, the host's other
    work), which run-to-run differences no longer blur. The native report and the gateway's (`stop`: as for run())."""
    from client.bench.loadtest.http import served_model
    from client.bench.loadtest.stack import request_shares, run_each, split

    validate_together(config)
    assert config.http is not None  # validate_together() checked
    native_config = replace(config, http=None)
    _check_broker(native_config)
    model = config.model or served_model(config.http, config.api_key, min(config.timeout, REACH_TIMEOUT_S))
    half_sessions, half_processes = config.sessions // 2, config.processes // 2
    limit = config.request_limit
    native_requests, http_requests = (None, None) if limit is None else request_shares(
        limit, [half_sessions, config.sessions - half_sessions])

    def side(http: bool, workload: Workload, sessions: int, processes: int, requests: int | None,
             duration: float | None) -> list[Any]:
        if http:
            return split("", model, config.timeout, workload, sessions, processes, requests, duration,
                         http=config.http, api_key=config.api_key)
        return split(config.broker or "", config.model, config.timeout, workload, sessions, processes, requests,
                     duration, config.broker_key, config.key)

    if config.warmup:
        warm = min(half_sessions, config.warmup)
        run_each([*side(False, config.workload(warmup=True), warm, 1, config.warmup, None),
                  *side(True, config.workload(warmup=True), warm, 1, config.warmup, None)], Tally(), _nothing, _nothing,
                 stop=stop)
    native_parts = side(False, config.workload(), half_sessions, half_processes, native_requests, config.duration)
    http_parts = side(True, config.workload(), config.sessions - half_sessions, config.processes - half_processes,
                      http_requests, config.duration)
    if _stopped(stop):
        native_raw, http_raw = _not_started(), _not_started()
    else:
        tally = Tally()
        with ProgressView(config.request_limit, config.duration, config.progress) as view:
            runs = run_each([*native_parts, *http_parts], tally, view.started, lambda: view.update(tally), log_level,
                            stop)
            view.update(tally)
        native_raw, http_raw = merge(runs[:len(native_parts)]), merge(runs[len(native_parts):])
    native = build_report(native_raw, native_config.mode, asdict(native_config))
    http = build_report(http_raw, config.mode, asdict(config))
    log.info("loadtest_done", mode="together", native_output_tokens_per_s=round(native.output_tokens_per_s, 1),
             http_output_tokens_per_s=round(http.output_tokens_per_s, 1))
    return native, http


def compare(native: Report, http: Report) -> dict[str, float | None]:
    """The gateway's run against the native one: throughput ratio, TTFT p50 and p99 added (ms)."""
    def added(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    return {"output_throughput_ratio": http.output_tokens_per_s / native.output_tokens_per_s if native.output_tokens_per_s else None,
            "ttft_p50_added_ms": added(http.ttft.p50, native.ttft.p50),
            "ttft_later_p50_added_ms": added(http.ttft_later.p50, native.ttft_later.p50),
            "ttft_p99_added_ms": added(http.ttft.p99, native.ttft.p99),
            "tpot_p50_added_ms": added(http.tpot.p50, native.tpot.p50)}


def _nothing() -> None:
    pass


# -- the command line ---------------------------------------------------------------------------


def writable_file(value: str) -> Path:
    """Argument type: a file whose folder exists (checked before the run, not after it: the figures would be lost)."""
    path = Path(value)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"no folder {str(path.parent)!r} to write {path.name!r} in")
    return path


def _env(name: str, default: str | None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def parser() -> argparse.ArgumentParser:
    d = LoadConfig()
    ap = argparse.ArgumentParser(prog="loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_argument_group("target")
    target.add_argument("--broker", type=zmq_address, default=_env("LOADTEST_BROKER", d.broker),
                        help="the broker's client address [env LOADTEST_BROKER] (default %(default)s)")
    target.add_argument("--broker-key", default=_env("LOADTEST_BROKER_KEY", None),
                        help="a broker with --keys: its public key file [env LOADTEST_BROKER_KEY]")
    target.add_argument("--key", default=_env("LOADTEST_KEY", None),
                        help="a broker with --keys: this client's key pair file, NAME.key_secret [env LOADTEST_KEY]")
    target.add_argument("--http", default=_env("LOADTEST_HTTP", None), metavar="URL",
                        help="drive the gateway's OpenAI API at URL (http://HOST:PORT) instead of the broker "
                             "[env LOADTEST_HTTP]")
    target.add_argument("--api-key", default=_env("LOADTEST_API_KEY", None),
                        help="with --http: the gateway's API key [env LOADTEST_API_KEY]")
    target.add_argument("--compare", nargs="?", const="after", choices=("after", "together"), default=None,
                        help="with --http: run the workload through the broker (--broker) first, then through the "
                             "gateway (`after`, the default), or half the sessions each way at once (`together`: "
                             "both measured under the same load at the same moments), and report both and how they "
                             "compare")
    target.add_argument("--in-process", action="store_true",
                        help="drive worker.engine.Engine in this process instead of the stack (no broker)")
    target.add_argument("--model", default=_env("LOADTEST_MODEL", None),
                        help="full stack: the model name sessions are placed on (default: any worker); in-process: "
                             "a .gguf file, a Hugging Face folder or random:PRESET (default: the bundled SmolLM2) "
                             "[env LOADTEST_MODEL]")
    target.add_argument("--device", default=d.device, help="in-process: auto, cpu, cuda or cuda:N (default %(default)s)")
    load = ap.add_argument_group("workload")
    load.add_argument("--sessions", type=int, default=d.sessions, help="concurrent sessions (default %(default)s)")
    load.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="P: prompt tokens per turn (default %(default)s)")
    load.add_argument("--max-tokens", type=int, default=d.max_tokens, help="M: tokens generated per turn (default %(default)s)")
    load.add_argument("--turns", type=int, default=d.turns, help="T: turns per conversation (default %(default)s)")
    load.add_argument("--fork-every", type=int, default=d.fork_every, metavar="K",
                      help="every K-th turn, fork the session, run one turn on the child and close it (default: never)")
    load.add_argument("--prompt-kind", choices=PROMPT_KINDS, default=d.prompt_kind,
                      help="random token ids or text from a word list, both from the seed (default %(default)s)")
    load.add_argument("--vocab-size", type=int, default=d.vocab_size,
                      help="token-id prompts draw ids from [0, V) (default %(default)s: valid for every model here)")
    load.add_argument("--temperature", type=float, default=d.temperature, help="(default %(default)s: greedy)")
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly M tokens per turn (benchmarks)")
    load.add_argument("--seed", type=int, default=d.seed, help="prompts and sampling seeds (default %(default)s)")
    load.add_argument("--max-context", type=int, default=d.max_context,
                      help="open a new session before a turn would pass this many tokens (default %(default)s)")
    length = ap.add_argument_group("length (default: one conversation per session, sessions x turns requests)")
    length.add_argument("--requests", type=int, default=None, help="generate requests in total")
    length.add_argument("--duration", type=float, default=None, help="seconds during which new requests start")
    out = ap.add_argument_group("run and output")
    load.add_argument("--warmup", type=int, default=d.warmup, metavar="N",
                      help="run N generate requests first, not measured (compilation, CUDA graphs; default none)")
    out.add_argument("--processes", type=int, default=d.processes,
                     help="client processes the sessions are split over (full stack; default %(default)s)")
    out.add_argument("--timeout", type=float, default=d.timeout, help="seconds to wait for each answer or chunk (default %(default)s)")
    out.add_argument("--json", type=writable_file, default=None, metavar="FILE", help="write every figure as JSON")
    out.add_argument("--plot", type=writable_file, default=None, metavar="FILE.png",
                     help="plot latency distributions and tokens/s over time")
    out.add_argument("--no-progress", action="store_true", help="no live progress bar")
    out.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=_env("LOADTEST_LOG_LEVEL", "warning"),
                     help="[env LOADTEST_LOG_LEVEL] (default %(default)s)")
    return ap


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        broker=args.broker, in_process=args.in_process, model=args.model, device=args.device, sessions=args.sessions,
        prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, turns=args.turns, requests=args.requests,
        duration=args.duration, ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed,
        processes=args.processes, fork_every=args.fork_every, prompt_kind=args.prompt_kind, max_context=args.max_context,
        progress=not args.no_progress and sys.stderr.isatty(), timeout=args.timeout, vocab_size=args.vocab_size,
        warmup=args.warmup, broker_key=args.broker_key, key=args.key, http=args.http, api_key=args.api_key,
    )


def main(argv: Sequence[str] | None = None) -> int:
    from broker.common import logs

    ap = parser()
    args = ap.parse_args(argv)
    logs.configure(args.log_level, role="loadtest")
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as e:
        ap.error(str(e))
    if args.compare and not config.http:
        ap.error("--compare needs --http (and --broker for the native run)")
    if args.compare == "together":
        try:
            validate_together(config)
        except ValueError as e:
            ap.error(f"--compare together: {e}")
    stop = Stop()
    with on_signals(stop):  # the first Ctrl-C (or SIGTERM) stops the run and reports, the next quits at once
        try:
            return _main(args, config, stop)
        except (LoadTestError, ValueError) as e:
            log.error("loadtest_failed", error=str(e))
            return 1
        except KeyboardInterrupt:
            log.warning("loadtest_quit")
            return stop.exit_code


def _main(args: argparse.Namespace, config: LoadConfig, stop: Stop) -> int:
    """Run what the arguments ask for, print the report(s), write --json and --plot; the exit code.

    With --compare the JSON has the comparison's shape whatever happens: a run stopped during its native part has
    no gateway run, and its "http" and "comparison" are null."""
    native: Report | None = None
    http: Report | None
    if args.compare == "together":
        native, http = run_together(config, log_level=args.log_level, stop=stop)
    elif args.compare:
        native = run(replace(config, http=None), log_level=args.log_level, stop=stop)
        # stopped during the native run: the gateway's is not started
        http = None if native.interrupted else run(config, log_level=args.log_level, stop=stop)
    else:
        http = run(config, log_level=args.log_level, stop=stop)
    from rich.console import Console

    console = Console()
    for shown in (native, http):
        if shown is not None:
            console.print(shown.table())
    report = http if http is not None else native
    assert report is not None
    out: dict[str, Any] = report.to_dict()
    if native is not None:
        figures = compare(native, http) if http is not None else None
        if figures is not None:
            console.print("gateway against native: " + ", ".join(
                f"{k} {v:.3f}" if v is not None else f"{k} n/a" for k, v in figures.items()))
        out = {"native": native.to_dict(), "http": None if http is None else http.to_dict(), "comparison": figures}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    if args.plot is not None:
        from client.bench.loadtest.plot import plot

        plot(report, args.plot)
    if stop.is_set():
        return stop.exit_code
    return 0 if report.completed else 1


if __name__ == "__main__":
    sys.exit(main())
