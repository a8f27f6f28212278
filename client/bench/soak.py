"""Soak test: churn sessions through the whole stack for a while and watch memory. `python -m client.bench.soak --help`.

`--sessions` users (asyncio tasks sharing one AsyncClient) loop over conversations: create a session, then
turns, each a text prompt appended and one action drawn from a seeded RNG: a generation (whole answer), a
streamed one, a stream closed after its first chunks (cancel), a fork whose child and parent continue together
greedily and must agree, or an info whose length must match what the user counted. A conversation closes its
session after its turns or when the context is nearly full, and the next one starts. Every failure counts
under its error code; a clean run has none. A user holds at most two sessions (a fork's parent and child),
so `--sessions` may be at most half the free slots.

A short warm-up (`--warmup`, every user, counted but not timed) lets caches and lazily built buffers reach
their size before the first memory sample. Then every `--sample-every` seconds: the memory used (GPU memory
from nvidia-smi when it answers, else the resident set of the worker when this script spawned it or was
given `--worker-pid`) and the live sessions (the broker's status). At the end: operations by type, errors by
code, memory at start/end/min/max with the live sessions of each, tokens/s. The leak check compares memory
at equal live-session counts between the first and the last third of the run; it always has one pair, the
sample before the users start and the one after they have all closed their sessions (live count as at start).

Exit codes: 0 clean; 1 an error, memory growth over `--max-growth-mib`, sessions left open, or a spawned
daemon exiting badly; 2 bad arguments or too few free slots; 3 the spawned stack did not start.

    python -m client.bench.soak --clients tcp://broker:5555 --sessions 16 --duration 600 --json soak.json
    python -m client.bench.soak --spawn --model random:smollm2-135m --device cuda --max-sessions 64 --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from broker.common import logs
from broker.common.arguments import positive_float, positive_int
from client.aio import AsyncClient, AsyncSession
from client.bench.loadtest.workload import WORDS
from client.errors import ClientError
from client.stack import Daemon, LocalStack, StackError, free_port

T = TypeVar("T")

EXIT_FAILED, EXIT_USAGE, EXIT_STARTUP = 1, 2, 3
ACTIONS = ("generate", "stream", "cancel", "fork", "info")
WEIGHTS = (3, 3, 1, 1, 1)  # mostly generation; forks and cancels often enough to churn slots and streams
SPAWN_TIMEOUT_S = 600.0  # model load (and CUDA graph capture) of a spawned worker
STOP_TIMEOUT_S = 60.0
WORKER = "soak-worker"  # the spawned worker's name
STATUS_TIMEOUT_S = 10.0  # the first call: a broker that is not there is reported soon
ERROR_SAMPLES = 20  # error messages kept for the report


class UsageError(Exception):
    """The run cannot be made as asked (exit code 2)."""


class StartupError(Exception):
    """The spawned stack did not come up (exit code 3)."""


class ForkMismatch(ClientError):
    """A fork did not continue like its parent: state bled between sessions or was copied wrong."""

    code = "fork_mismatch"


class LengthMismatch(ClientError):
    """A session's length is not what its turns added up to: tokens were lost or added."""

    code = "length_mismatch"


@dataclass(frozen=True)
class SoakConfig:
    clients: str
    sessions: int | None  # None: half the free slots
    duration_s: float
    warmup_s: float
    sample_every_s: float
    max_tokens: int
    prompt_words: int
    turns: int
    timeout_s: float
    seed: int
    session_model: str | None  # the model sessions ask for (None: any worker's)
    model: str | None  # the spawned worker's --model (None: the bundled one)
    max_growth_mib: float
    memory: str  # auto, gpu, rss, none
    worker_pid: int | None
    broker_key: str | None
    key: str | None
    spawn: bool
    device: str
    max_sessions: int
    max_context: int
    json_path: Path | None
    worker_metrics: str | None = None  # the worker's /metrics URL (its torch allocator is sampled too)


# -- what is counted ------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Operations, latencies, errors and tokens of one phase (warm-up or run)."""

    ops: Counter[str] = field(default_factory=Counter)
    latency_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[dict[str, str]] = field(default_factory=list)
    tokens: int = 0

    def done(self, op: str, seconds: float) -> None:
        self.ops[op] += 1
        self.latency_s[op].append(seconds)

    def failed(self, op: str, code: str, message: str) -> None:
        self.errors[code] += 1
        if len(self.error_samples) < ERROR_SAMPLES:
            self.error_samples.append({"op": op, "code": code, "message": message[:300]})


@dataclass(frozen=True)
class Sample:
    t_s: float  # since the run phase began
    memory_mib: float | None
    live_sessions: int | None
    # The worker's torch allocator (from its /metrics, when known): memory in tensors, and what it holds cached.
    torch_allocated_mib: float | None = None
    torch_reserved_mib: float | None = None
    worker_sessions: int | None = None  # the sessions the worker itself holds (the broker's count is live_sessions)
    mapped_mib: float | None = None  # the worker's session table: memory mapped for slots (in use and the spare)


WORKER_GAUGES = ("gpu_memory_allocated_bytes", "gpu_memory_reserved_bytes", "num_sessions", "session_state_bytes")


def worker_gauges(metrics_url: str | None) -> dict[str, float]:
    """The worker's allocator and session gauges, read from its Prometheus metrics ({} when unknown)."""
    if metrics_url is None:
        return {}
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        for name in WORKER_GAUGES:
            if line.startswith(f"sessionserve:{name}{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


# -- memory probes ----------------------------------------------------------------------------------------


class MemoryProbe(Protocol):
    name: str

    def read(self) -> float | None: ...


class GpuMemory:
    """GPU memory used (MiB) as nvidia-smi reports it: one GPU's, or the sum over all GPUs."""

    def __init__(self, index: int | None) -> None:
        self.index = index
        self.name = "gpu memory used (nvidia-smi)" + ("" if index is None else f", GPU {index}")

    def read(self) -> float | None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
            values = [float(line) for line in out.split()]
        except (OSError, subprocess.SubprocessError, ValueError):
            return None
        if self.index is not None:
            return values[self.index] if self.index < len(values) else None
        return sum(values) if values else None


class ProcessRss:
    """A process's resident set (MiB), from /proc/PID/status."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.name = f"resident set of worker pid {pid}"

    def read(self) -> float | None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024  # kB
        except (OSError, ValueError):
            return None
        return None


class NoMemory:
    name = "none"

    def read(self) -> float | None:
        return None


def choose_probe(kind: str, device: str, worker_pid: int | None) -> MemoryProbe:
    """`auto`: nvidia-smi when it answers, else the worker's resident set when its pid is known, else none."""
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else None
    if kind in ("auto", "gpu") and shutil.which("nvidia-smi"):
        gpu = GpuMemory(index)
        if gpu.read() is not None:
            return gpu
    if kind == "gpu":
        raise UsageError("--memory gpu: nvidia-smi is not available")
    if kind in ("auto", "rss") and worker_pid is not None:
        return ProcessRss(worker_pid)
    if kind == "rss":
        raise UsageError("--memory rss needs the worker's pid: --spawn or --worker-pid")
    return NoMemory()


# -- the leak check -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeakCheck:
    ok: bool
    growth_mib: float | None  # the largest growth over the live counts compared; None: nothing to compare
    by_live: dict[int, tuple[float, float]]  # live sessions -> (median MiB in the first third, in the last third)
    note: str


def leak_check(samples: Sequence[Sample], max_growth_mib: float) -> LeakCheck:
    """Did memory grow between the first and the last third of the run (medians)?

    With the worker's own gauges (a spawned worker, or --worker-metrics) the device memory is taken apart:
    what torch's allocator holds cached (it grows to the largest working set once, then stays), what the
    session table has mapped (slots in use: set by the live sessions at that instant), and the rest, which
    must not grow at all. Without them: the memory at equal live-session counts, which the allocator's
    cache and sessions being opened between two reads make noisier."""
    measured = [s for s in samples if s.memory_mib is not None and s.live_sessions is not None]
    if not measured:
        return LeakCheck(True, None, {}, "no memory samples: not checked")
    end = max(s.t_s for s in measured)
    first: dict[int, list[float]] = defaultdict(list)
    last: dict[int, list[float]] = defaultdict(list)
    for s in measured:
        assert s.memory_mib is not None and s.live_sessions is not None
        if s.t_s <= end / 3:
            first[s.live_sessions].append(s.memory_mib)
        if s.t_s >= 2 * end / 3:
            last[s.live_sessions].append(s.memory_mib)
    by_live = {n: (statistics.median(first[n]), statistics.median(last[n])) for n in sorted(first.keys() & last.keys())}
    parts = [s for s in measured if s.torch_reserved_mib is not None and s.mapped_mib is not None]
    if len(parts) >= 3:
        def rest(s: Sample) -> float:
            assert s.memory_mib is not None and s.torch_reserved_mib is not None and s.mapped_mib is not None
            return s.memory_mib - s.torch_reserved_mib - s.mapped_mib

        early = statistics.median(rest(s) for s in parts if s.t_s <= end / 3)
        late = statistics.median(rest(s) for s in parts if s.t_s >= 2 * end / 3)
        growth = late - early
        ok = growth <= max_growth_mib
        return LeakCheck(ok, growth, by_live, f"memory besides the allocator's cache and the mapped slots: {early:.1f} -> "
                                              f"{late:.1f} MiB, {growth:+.1f} MiB {'<=' if ok else '>'} {max_growth_mib:g} MiB")
    if not by_live:
        return LeakCheck(True, None, {}, "no live-session count seen in both the first and the last third: not checked")
    growth = max(b - a for a, b in by_live.values())
    ok = growth <= max_growth_mib
    return LeakCheck(ok, growth, by_live, f"max growth at equal live sessions {growth:+.1f} MiB "
                                          f"{'<=' if ok else '>'} {max_growth_mib:g} MiB")


async def timed(tally: Tally, name: str, work: Awaitable[T]) -> T | None:
    """Await one operation: its latency is counted, or its error under its code (and None is returned)."""
    start = time.perf_counter()
    try:
        result = await work
    except ClientError as e:
        tally.failed(name, e.code, e.message)
        return None
    except Exception as e:  # anything else is a bug worth a line in the report, not a crash of the soak
        tally.failed(name, f"exception:{type(e).__name__}", str(e))
        return None
    tally.done(name, time.perf_counter() - start)
    return result


# -- one user -------------------------------------------------------------------------------------------


class User:
    """One simulated user: conversations until the deadline, every operation timed and every failure counted."""

    def __init__(self, client: AsyncClient, config: SoakConfig, index: int, tally: Tally, deadline: float) -> None:
        self.client = client
        self.config = config
        self.rng = random.Random(config.seed * 1_000_003 + index)
        self.tally = tally
        self.deadline = deadline

    async def run(self) -> None:
        while time.monotonic() < self.deadline:
            await self.conversation()

    async def op(self, name: str, work: Awaitable[T]) -> T | None:
        return await timed(self.tally, name, work)

    async def conversation(self) -> None:
        session = await self.op("create", self.client.session(self.config.session_model))
        if session is None:
            await asyncio.sleep(0.1)  # counted; do not spin on a broken stack
            return
        length = 0
        try:
            for _ in range(self.rng.randint(1, self.config.turns)):
                if time.monotonic() >= self.deadline:
                    break
                text = " ".join(self.rng.choices(WORDS, k=self.config.prompt_words))
                room = session.max_context - length - (len(text.encode()) + 2)  # a token is at least a byte
                if room < self.config.max_tokens + 1:
                    break
                appended = await self.op("append", session.append(text=" " + text))
                if appended is None:
                    break
                action = self.rng.choices(ACTIONS, WEIGHTS)[0]
                after = await self.op(action, self.act(action, session, appended))
                if after is None:
                    break
                length = after
        finally:
            await self.op("close", session.close())

    async def act(self, action: str, session: AsyncSession, length: int) -> int:
        """Run one action; returns the session's length afterwards."""
        max_tokens = self.rng.randint(1, self.config.max_tokens)
        if action == "generate":
            temperature = self.rng.choice((0.0, 0.8))
            g = await session.generate(max_tokens=max_tokens, temperature=temperature, seed=self.rng.randrange(1 << 31),
                                       ignore_eos=self.rng.random() < 0.5)
            self.tally.tokens += len(g.token_ids)
            return g.session_length
        if action == "stream":
            stream = await session.generate(max_tokens=max_tokens, ignore_eos=True, stream=True)
            async for chunk in stream:
                self.tally.tokens += len(chunk.token_ids)
            assert stream.result is not None  # set by the last chunk
            return stream.result.session_length
        if action == "cancel":
            stream = await session.generate(max_tokens=self.config.max_tokens, ignore_eos=True, stream=True)
            async for chunk in stream:
                self.tally.tokens += len(chunk.token_ids)
                if chunk.finish_reason is None:
                    break  # close early: the generation is cancelled
            stream.close()
            return (await session.info()).length
        if action == "fork":
            return await self.fork(session, max_tokens)
        info = await session.info()
        if info.length != length:
            raise LengthMismatch(f"info says {info.length} tokens, the user counted {length}")
        return info.length

    async def fork(self, parent: AsyncSession, max_tokens: int) -> int:
        """The child continues exactly as its parent does: both generate greedily at once and must agree."""
        child = await parent.fork()
        try:
            a, b = await asyncio.gather(parent.generate(max_tokens=max_tokens, ignore_eos=True),
                                        child.generate(max_tokens=max_tokens, ignore_eos=True))
        finally:
            await child.close()
        self.tally.tokens += len(a.token_ids) + len(b.token_ids)
        if a.token_ids != b.token_ids:
            raise ForkMismatch(f"parent {a.token_ids[:8]}... and fork {b.token_ids[:8]}... differ")
        return a.session_length


# -- sampling -------------------------------------------------------------------------------------------


async def live_sessions(client: AsyncClient, tally: Tally) -> int | None:
    """Sessions the broker holds, over all workers (a failed status call counts as an error)."""
    workers = await timed(tally, "status", client.status())
    return None if workers is None else sum(w.sessions for w in workers)


async def sample(client: AsyncClient, probe: MemoryProbe, tally: Tally, t0: float, metrics_url: str | None = None) -> Sample:
    live = await live_sessions(client, tally)
    memory = await asyncio.to_thread(probe.read)
    gauges = await asyncio.to_thread(worker_gauges, metrics_url)
    mib = 1 << 20
    allocated, reserved = gauges.get("gpu_memory_allocated_bytes"), gauges.get("gpu_memory_reserved_bytes")
    held = gauges.get("num_sessions")
    return Sample(round(time.monotonic() - t0, 3), memory, live, None if allocated is None else allocated / mib,
                  None if reserved is None else reserved / mib, None if held is None else int(held),
                  None if "session_state_bytes" not in gauges else gauges["session_state_bytes"] / mib)


async def sampler(client: AsyncClient, probe: MemoryProbe, tally: Tally, t0: float, every_s: float,
                  samples: list[Sample], stop: asyncio.Event, metrics_url: str | None) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        except asyncio.TimeoutError:
            samples.append(await sample(client, probe, tally, t0, metrics_url))


# -- the run --------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    users: int
    warmup: Tally
    run: Tally
    run_s: float
    samples: list[Sample]
    probe: str


async def soak(config: SoakConfig, probe: MemoryProbe) -> Outcome:
    auth: dict[str, Any] = {}
    if config.broker_key is not None:
        auth["broker_key"] = config.broker_key
    if config.key is not None:
        auth["key"] = config.key
    async with AsyncClient(config.clients, timeout=config.timeout_s, **auth) as client:
        users = await user_count(client, config)
        warmup, run = Tally(), Tally()
        if config.warmup_s > 0:
            await run_users(client, config, users, warmup, time.monotonic() + config.warmup_s)
        t0 = time.monotonic()
        url = config.worker_metrics
        samples = [await sample(client, probe, run, t0, url)]
        stop = asyncio.Event()
        watcher = asyncio.create_task(sampler(client, probe, run, t0, config.sample_every_s, samples, stop, url))
        await run_users(client, config, users, run, t0 + config.duration_s)
        run_s = time.monotonic() - t0
        stop.set()
        await watcher
        samples.append(await sample(client, probe, run, t0, url))
    return Outcome(users, warmup, run, run_s, samples, probe.name)


async def user_count(client: AsyncClient, config: SoakConfig) -> int:
    """--sessions, checked against the free slots (a user may hold two sessions); by default half of them."""
    wanted = config.session_model
    workers = await client.status(timeout=min(config.timeout_s, STATUS_TIMEOUT_S))
    free = sum(w.free_slots for w in workers if wanted is None or w.model.casefold() == wanted.casefold())
    users = config.sessions if config.sessions is not None else free // 2
    if users < 1 or 2 * users > free:
        raise UsageError(f"{users} users need up to {2 * users} session slots; the broker has {free} free")
    return users


async def run_users(client: AsyncClient, config: SoakConfig, users: int, tally: Tally, deadline: float) -> None:
    await asyncio.gather(*(User(client, config, i, tally, deadline).run() for i in range(users)))


# -- a stack of its own ---------------------------------------------------------------------------------


@dataclass
class Spawned:
    clients: str
    worker_pid: int
    log_dir: Path
    metrics_url: str
    exit_codes: dict[str, int | None] = field(default_factory=dict)


@contextmanager
def spawned_stack(config: SoakConfig) -> Iterator[Spawned]:
    """A broker and one worker on free loopback ports (the daemons' own heartbeats); stopped with SIGTERM (worker
    first: it drains) on exit, their exit codes then in the Spawned (None: had to be killed)."""
    metrics_port = free_port()
    stack = LocalStack(Path(tempfile.mkdtemp(prefix="sessionserve-soak-")), heartbeats=None)
    spawned: Spawned | None = None
    try:
        stack.start_broker()
        worker = stack.start_worker(WORKER, model=config.model, device=config.device, max_sessions=config.max_sessions,
                                    max_context=config.max_context, extra=["--metrics-port", str(metrics_port)])
        spawned = Spawned(stack.clients, worker.pid, stack.log_dir, f"http://127.0.0.1:{metrics_port}/metrics")
        wait_registered(stack, worker)
        yield spawned
    finally:
        codes = stack.stop(STOP_TIMEOUT_S)
        if spawned is not None:
            spawned.exit_codes.update(worker=codes.get(WORKER), broker=codes.get("broker"))


def wait_registered(stack: LocalStack, worker: Daemon) -> None:
    try:
        stack.wait_for_workers({WORKER}, timeout=SPAWN_TIMEOUT_S)
    except StackError as e:
        if worker.alive:
            raise StartupError(f"the worker did not register within {SPAWN_TIMEOUT_S:g} s (logs in {stack.log_dir})") from e
        raise StartupError(f"the worker exited with code {worker.proc.returncode} (logs in {stack.log_dir})") from e


# -- the report -----------------------------------------------------------------------------------------


def op_rows(tally: Tally) -> dict[str, dict[str, float]]:
    rows = {}
    for op in sorted(tally.ops):
        ms = sorted(1000 * s for s in tally.latency_s[op])
        rows[op] = {"count": tally.ops[op], "p50_ms": round(ms[len(ms) // 2], 2),
                    "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2), "max_ms": round(ms[-1], 2)}
    return rows


def report(outcome: Outcome, config: SoakConfig, stack: Spawned | None) -> dict[str, Any]:
    errors = outcome.warmup.errors + outcome.run.errors
    measured = [s for s in outcome.samples if s.memory_mib is not None]
    leak = leak_check(outcome.samples, config.max_growth_mib)
    start, end = outcome.samples[0], outcome.samples[-1]
    sessions_ok = start.live_sessions is not None and start.live_sessions == end.live_sessions
    daemons_ok = stack is None or all(code == 0 for code in stack.exit_codes.values())
    memory = None if not measured else {
        "start": asdict(start), "end": asdict(end),
        "min": asdict(min(measured, key=lambda s: s.memory_mib or 0.0)),
        "max": asdict(max(measured, key=lambda s: s.memory_mib or 0.0)),
    }
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "users": outcome.users,
        "run_s": round(outcome.run_s, 3),
        "ops": op_rows(outcome.run),
        "warmup_ops": op_rows(outcome.warmup),
        "errors": dict(errors),
        "error_samples": outcome.warmup.error_samples + outcome.run.error_samples,
        "tokens": outcome.run.tokens,
        "tokens_per_s": round(outcome.run.tokens / outcome.run_s, 1) if outcome.run_s > 0 else 0.0,
        "memory_probe": outcome.probe,
        "memory": memory,
        "samples": [asdict(s) for s in outcome.samples],
        "leak_check": {"ok": leak.ok, "growth_mib": leak.growth_mib, "note": leak.note,
                       "by_live": {str(n): list(v) for n, v in leak.by_live.items()}},
        "sessions_returned": sessions_ok,
        "daemons": None if stack is None else {"log_dir": str(stack.log_dir), "exit_codes": stack.exit_codes},
        "passed": not errors and leak.ok and sessions_ok and daemons_ok,
    }


def _memory(entry: dict[str, Any]) -> str:
    memory = "-" if entry["memory_mib"] is None else f"{entry['memory_mib']:.1f} MiB"
    return f"{memory} ({entry['live_sessions']} live)"


def summary(r: dict[str, Any]) -> str:
    lines = [f"soak: {r['users']} users for {r['run_s']:.1f} s (warm-up {r['config']['warmup_s']:g} s) "
             f"on {r['config']['clients']}",
             f"{'operation':<10}{'count':>8}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}"]
    for op, row in r["ops"].items():
        lines.append(f"{op:<10}{row['count']:>8}{row['p50_ms']:>10.1f}{row['p99_ms']:>10.1f}{row['max_ms']:>10.1f}")
    warm = sum(row["count"] for row in r["warmup_ops"].values())
    lines.append(f"(warm-up: {warm} operations)")
    errors = ", ".join(f"{code} {n}" for code, n in sorted(r["errors"].items())) or "none"
    lines.append(f"errors: {errors}")
    lines += [f"  {e['op']}: {e['code']}: {e['message']}" for e in r["error_samples"][:5]]
    lines.append(f"tokens: {r['tokens']} generated, {r['tokens_per_s']:.1f} tokens/s")
    m = r["memory"]
    lines.append(f"memory: {r['memory_probe']}")
    if m is not None:
        lines.append(f"  start {_memory(m['start'])}, end {_memory(m['end'])}, "
                     f"min {_memory(m['min'])}, max {_memory(m['max'])}, {len(r['samples'])} samples")
        compared = ", ".join(f"{n} live: {a:.1f} -> {b:.1f}" for n, (a, b) in r["leak_check"]["by_live"].items())
        if compared:
            lines.append(f"  equal live sessions, first vs last third (MiB): {compared}")
    for key, what in (("torch_allocated_mib", "torch allocator, in tensors"),
                      ("torch_reserved_mib", "torch allocator, held"), ("mapped_mib", "session table, mapped")):
        at_zero = [s[key] for s in r["samples"] if s[key] is not None and s["live_sessions"] == r["samples"][0]["live_sessions"]]
        peak = max((s[key] for s in r["samples"] if s[key] is not None), default=None)
        if at_zero and peak is not None:
            lines.append(f"  worker {what}: {at_zero[0]:.1f} -> {at_zero[-1]:.1f} MiB at the start's "
                         f"live count, peak {peak:.1f} MiB")
    lines.append(f"leak check: {r['leak_check']['note']}: {'ok' if r['leak_check']['ok'] else 'FAILED'}")
    start, end = r["samples"][0]["live_sessions"], r["samples"][-1]["live_sessions"]
    lines.append(f"live sessions: {start} at start, {end} at end: {'ok' if r['sessions_returned'] else 'FAILED'}")
    held = r["samples"][-1]["worker_sessions"]
    if held is not None:
        lines.append(f"sessions the worker holds at the end: {held}")
    if r["daemons"] is not None:
        lines.append(f"spawned daemons: exit codes {r['daemons']['exit_codes']}, logs in {r['daemons']['log_dir']}")
    lines.append("PASSED" if r["passed"] else "FAILED")
    return "\n".join(lines)


# -- the command line -----------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m client.bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_argument_group("target")
    target.add_argument("--clients", default="tcp://127.0.0.1:5555", help="the broker's client address (default %(default)s)")
    target.add_argument("--broker-key", default=None, metavar="FILE", help="the broker's public key (CURVE)")
    target.add_argument("--key", default=None, metavar="FILE", help="this client's key pair file (NAME.key_secret)")
    target.add_argument("--session-model", default=None, metavar="NAME",
                        help="the model sessions ask for, as `broker status` names it (default: any worker's)")
    spawn_ = ap.add_argument_group("a stack of its own (--spawn)")
    spawn_.add_argument("--spawn", action="store_true", help="start a broker and one worker on free loopback ports")
    spawn_.add_argument("--model", default=None, help="the spawned worker's --model (default: the bundled SmolLM2)")
    spawn_.add_argument("--device", default="auto", help="the spawned worker's --device (default %(default)s)")
    spawn_.add_argument("--max-sessions", type=positive_int, default=64, help="the spawned worker's (default %(default)s)")
    spawn_.add_argument("--max-context", type=positive_int, default=2048, help="the spawned worker's (default %(default)s)")
    load = ap.add_argument_group("load")
    load.add_argument("--duration", type=positive_float, default=60.0, help="seconds of churn (default %(default)s)")
    load.add_argument("--warmup", type=float, default=5.0, help="seconds of churn before the first sample (default %(default)s)")
    load.add_argument("--sessions", type=positive_int, default=None, help="concurrent users (default: half the free slots)")
    load.add_argument("--max-tokens", type=positive_int, default=64, help="most tokens per generation (default %(default)s)")
    load.add_argument("--prompt-words", type=positive_int, default=16, help="words per turn's prompt (default %(default)s)")
    load.add_argument("--turns", type=positive_int, default=6, help="most turns per conversation (default %(default)s)")
    load.add_argument("--timeout", type=positive_float, default=120.0, help="seconds to wait for each answer (default %(default)s)")
    load.add_argument("--seed", type=int, default=0)
    watch = ap.add_argument_group("memory and output")
    watch.add_argument("--memory", choices=("auto", "gpu", "rss", "none"), default="auto",
                       help="what to sample: auto = nvidia-smi if it answers, else the worker's resident set if known")
    watch.add_argument("--worker-pid", type=int, default=None, help="a local worker's pid, for --memory rss without --spawn")
    watch.add_argument("--worker-metrics", default=None, metavar="URL",
                       help="the worker's /metrics URL, to sample its torch allocator too (--spawn sets it)")
    watch.add_argument("--sample-every", type=positive_float, default=2.0, help="seconds between samples (default %(default)s)")
    watch.add_argument("--max-growth-mib", type=float, default=64.0,
                       help="memory growth at equal live sessions that fails the run (default %(default)s)")
    watch.add_argument("--json", type=Path, default=None, metavar="FILE", help="write everything as JSON")
    watch.add_argument("--log-level", choices=logs.LEVELS, default="warning")
    return ap


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        clients=args.clients, sessions=args.sessions, duration_s=args.duration, warmup_s=max(0.0, args.warmup),
        sample_every_s=args.sample_every, max_tokens=args.max_tokens, prompt_words=args.prompt_words,
        turns=args.turns, timeout_s=args.timeout, seed=args.seed, session_model=args.session_model, model=args.model,
        max_growth_mib=args.max_growth_mib, memory=args.memory, worker_pid=args.worker_pid,
        broker_key=args.broker_key, key=args.key, spawn=args.spawn, device=args.device,
        max_sessions=args.max_sessions, max_context=args.max_context, json_path=args.json,
        worker_metrics=args.worker_metrics,
    )


def execute(config: SoakConfig, run: Callable[[SoakConfig, MemoryProbe], Outcome]) -> int:
    """Start the stack if asked, run, report. Returns the exit code."""
    if config.spawn and (config.broker_key or config.key):
        raise UsageError("--spawn starts a broker without keys: --broker-key/--key do not apply")
    if not config.spawn:
        probe = choose_probe(config.memory, config.device, config.worker_pid)
        result = report(run(config, probe), config, None)
    else:
        print(f"starting a broker and a worker ({config.model or 'bundled model'} on {config.device})...", flush=True)
        with spawned_stack(config) as stack:
            here = replace(config, clients=stack.clients, worker_metrics=config.worker_metrics or stack.metrics_url)
            probe = choose_probe(config.memory, config.device, stack.worker_pid)
            outcome = run(here, probe)
        result = report(outcome, here, stack)
    print(summary(result))
    if config.json_path is not None:
        config.json_path.write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.log_level)
    config = config_from_args(args)
    try:
        return execute(config, lambda c, probe: asyncio.run(soak(c, probe)))
    except UsageError as e:
        print(f"soak: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StartupError as e:
        print(f"soak: {e}", file=sys.stderr)
        return EXIT_STARTUP
    except ClientError as e:
        print(f"soak: the broker did not answer: {e.code}: {e.message}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
