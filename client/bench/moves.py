"""Moving sessions: the pause of one moved session, and the time to drain a worker of many, through the real daemons.
`python -m client.bench.moves --help`.

Twice, on a fresh stack each time (a broker and workers w1, w2 on loopback): w1 takes `--sessions` sessions (1, then
`--drain-sessions`) of `--tokens` prompt tokens each, computed (one generated token each), then w2 registers and w1
gets SIGTERM: its sessions move to w2. Printed: per moved session the pause (from the broker's MOVE to the switch of
its route: how long its requests would have waited, the broker's `session_moved` log lines), and for the drain the
time from SIGTERM to the broker's last move (`sessions_moved_off`) and to w1's exit. After the drain one session
generates on w2 to show it is served.

    python -m client.bench.moves                                                   # random:tiny on the CPU
    python -m client.bench.moves --model random:smollm2-135m --device cuda         # both workers on one GPU (H100)
    python -m client.bench.moves --model random:smollm2-135m --device cuda --w2-device cuda:1
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from client.stack import LocalStack


@dataclass
class Drained:
    sessions: int
    tokens: int
    pauses_ms: list[float]
    moved_s: float  # SIGTERM -> the broker's last move
    exit_s: float  # SIGTERM -> w1 exited
    stages_ms: dict[str, float]  # median per session: MOVE -> state out of w1, -> imported on w2, -> route switched


def _events(log: Path, name: str) -> list[dict[str, object]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if f'"{name}"' in line:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                out.append(event)
    return out


def _at(event: dict[str, object]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def drain_once(args: argparse.Namespace, sessions: int, log_dir: Path) -> Drained:
    rng = random.Random(0)
    capacity = max(sessions, 1)
    context = args.tokens + 16
    worker = {"model": args.model, "max_sessions": capacity, "max_context": context}
    extra = ["--threads", str(args.threads)] if args.threads else []
    log_dir.mkdir(parents=True, exist_ok=True)
    with LocalStack(log_dir) as stack:
        stack.start_broker(["--io-threads", str(args.io_threads), "--moves-per-worker", str(args.moves_per_worker)])
        w1 = stack.start_worker("w1", device=args.device, extra=extra, **worker)
        stack.wait_for_workers({"w1"}, timeout=300)
        with stack.client(timeout=600) as c:
            opened = [c.session() for _ in range(sessions)]
            for s in opened:
                s.generate(prompt_ids=[rng.randrange(1, 400) for _ in range(args.tokens)], max_tokens=1,
                           ignore_eos=True)
            stack.start_worker("w2", device=args.w2_device or args.device, extra=extra, **worker)
            stack.wait_for_workers({"w1", "w2"}, timeout=300)
            start = time.time()
            w1.proc.send_signal(signal.SIGTERM)
            w1.proc.wait(timeout=600)
            exited = time.time() - start
            assert stack.broker is not None
            moved = _events(stack.broker.log, "session_moved")
            done = _events(stack.broker.log, "sessions_moved_off")
            if len(moved) != sessions:
                raise SystemExit(f"{len(moved)} of {sessions} sessions moved (logs in {log_dir})")
            if opened:
                opened[0].generate(max_tokens=4, ignore_eos=True)  # served where it went
                assert opened[0].info().worker == "w2"
        stages = _stages(moved, _events(stack.broker.log, "session_moving"), _events(w1.log, "session_sending"),
                         _events(stack.workers["w2"].log, "session_received"))
    pauses = [float(str(e["pause_ms"])) for e in moved]
    return Drained(sessions, args.tokens, pauses, (_at(done[0]) - start) if done else float("nan"), exited, stages)


def _stages(moved: list[dict[str, object]], moving: list[dict[str, object]], sending: list[dict[str, object]],
            received: list[dict[str, object]]) -> dict[str, float]:
    """Where each session's pause went (medians, ms), from the daemons' log lines: the broker's MOVE to the source's
    state leaving (copied out of the slot, checksummed), to the target's import (relayed through the broker, copied
    in, checksum checked, in a slot), to the broker's route switch (the source's release)."""
    at = {name: {str(e["session"]): _at(e) for e in events}
          for name, events in (("moving", moving), ("sending", sending), ("received", received), ("moved", moved))}
    split: dict[str, list[float]] = {"export": [], "relay_import": [], "release_switch": []}
    for sid, t0 in at["moving"].items():
        t1, t2, t3 = at["sending"].get(sid), at["received"].get(sid), at["moved"].get(sid)
        if t1 is None or t2 is None or t3 is None:
            continue
        split["export"].append((t1 - t0) * 1e3)
        split["relay_import"].append((t2 - t1) * 1e3)
        split["release_switch"].append((t3 - t2) * 1e3)
    return {k: statistics.median(v) for k, v in split.items() if v}


def report(d: Drained) -> str:
    p = sorted(d.pauses_ms)
    pct = (lambda q: p[min(len(p) - 1, int(q * len(p)))]) if p else (lambda q: float("nan"))
    return (f"{d.sessions} session(s) of {d.tokens} tokens: pause per session median {statistics.median(p):.1f} ms, "
            f"p90 {pct(0.9):.1f} ms, max {p[-1]:.1f} ms; SIGTERM to last move {d.moved_s:.3f} s, to w1's exit "
            f"{d.exit_s:.3f} s; median stages " + ", ".join(f"{k} {v:.1f} ms" for k, v in d.stages_ms.items()))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m client.bench.moves", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:tiny", help="worker --model (default %(default)s)")
    ap.add_argument("--device", default="cpu", help="w1's --device (default %(default)s)")
    ap.add_argument("--w2-device", default=None, help="w2's --device (default: --device)")
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens per session (default %(default)s)")
    ap.add_argument("--drain-sessions", type=int, default=64, help="sessions of the drain (default %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="worker --threads (default: the workers' own)")
    ap.add_argument("--io-threads", type=int, default=1, help="broker --io-threads (default %(default)s)")
    ap.add_argument("--moves-per-worker", type=int, default=4, help="broker --moves-per-worker (default %(default)s)")
    ap.add_argument("--log-dir", type=Path, default=None, help="daemon logs (default: a temporary folder)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import tempfile

    root = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-moves-"))
    one = drain_once(args, 1, root / "one")
    print(f"one moved session: {report(one)}")
    many = drain_once(args, args.drain_sessions, root / "many")
    print(f"drain: {report(many)}")
    print(f"(model {args.model}, devices {args.device} -> {args.w2_device or args.device}, broker --io-threads "
          f"{args.io_threads} --moves-per-worker {args.moves_per_worker}; logs in {root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
