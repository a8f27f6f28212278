"""GPU memory under session churn, in-process: is memory at zero live sessions the same after every round?

Each round opens `--sessions` sessions, appends prompts of varied lengths, forks a quarter of them,
generates on all of them together with varied sampling (greedy, temperature, top-p, top-k, seeds), closes a few
streams early (cancel), then closes everything. After each round (all work finished, zero live sessions) it prints the device memory in
use (driver: total - free), torch's allocated and reserved bytes and the table's mapped bytes; then it releases the
slots the table keeps mapped for reuse (closed sessions' slots keep their pages until a create takes them or the
worker's idle trim unmaps them: `Engine.release_idle_slots`) and prints the device memory once more.

    python -m worker.bench.memory_churn --rounds 20 --sessions 32 [--model random:smollm2-135m] [--json FILE]

Exit status 1 when driver-level memory at zero live sessions, with the kept slots released, grows by more than
--max-growth-mib between the second round (the first warms caches up) and the last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from worker.engine import Engine

MIB = 1 << 20


def triton_kernels() -> int:
    """Triton kernels compiled so far (each specialization is a module loaded into device memory)."""
    from triton.runtime.jit import JITFunction

    from worker.kernels import attention as triton_attention
    from worker.kernels import fused as triton_fused

    count = 0
    for module in (triton_attention, triton_fused):
        for fn in vars(module).values():
            for cache in getattr(fn, "device_caches", {}).values() if isinstance(fn, JITFunction) else ():
                count += len(cache[0]) if isinstance(cache, tuple) else 0
    return count


def stack_bytes() -> int:
    """The context's per-thread local memory (CU_LIMIT_STACK_SIZE): the driver grows it, for every resident
    thread of the device, when a kernel needing more is launched, and never shrinks it by itself."""
    from cuda.bindings import driver

    err, value = driver.cuCtxGetLimit(driver.CUlimit.CU_LIMIT_STACK_SIZE)
    return int(value) if err == driver.CUresult.CUDA_SUCCESS else -1


def measure(engine: Engine) -> dict[str, float]:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "device_used_mib": (total - free) / MIB,
        "torch_allocated_mib": torch.cuda.memory_allocated() / MIB,
        "torch_reserved_mib": torch.cuda.memory_reserved() / MIB,
        "table_mapped_mib": engine.table.backend.mapped_bytes() / MIB,
        "live_sessions": float(len(engine.sessions())),
        "triton_kernels": float(triton_kernels()),
        "stack_bytes": float(stack_bytes()),
    }


def one_round(engine: Engine, rng: random.Random, sessions: int, prompt_max: int = 400, forks_too: bool = True,
              kept: list[str] | None = None) -> int:
    """`kept`: reuse these sessions (never closed) instead of opening new ones: steps without churn."""
    sids = kept if kept is not None else [engine.create_session() for _ in range(sessions)]
    for sid in sids:
        if kept is not None and engine.session_length(sid) + prompt_max + 200 > engine.max_context:
            continue
        engine.append(sid, token_ids=[rng.randrange(1, 4000) for _ in range(rng.randint(8, prompt_max))])
    forks = [engine.fork(sid) for sid in rng.sample(sids, max(1, sessions // 4))] if forks_too else []
    requests: list[tuple[str, dict[str, object]]] = []
    for sid in sids + forks:
        kind = rng.randrange(4)
        params: dict[str, object] = {"max_tokens": rng.randint(8, 96), "ignore_eos": True}
        if kind >= 1:
            params.update(temperature=rng.choice([0.5, 0.8, 1.2]), seed=rng.randrange(1 << 30))
        if kind == 2:
            params["top_p"] = rng.choice([0.5, 0.9])
        if kind == 3:
            params["top_k"] = rng.choice([1, 20, 200])
        requests.append((sid, params))
    tokens = sum(len(g.token_ids) for g in engine.generate_many(requests))
    for sid in rng.sample(sids, max(1, sessions // 8)):  # streams closed after their first chunk: cancelled
        stream = engine.stream(sid, max_tokens=64, ignore_eos=True)
        tokens += len(next(stream).token_ids)
        stream.close()
    for sid in (sids if kept is None else []) + forks:
        engine.close(sid)
    return tokens


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.bench.memory_churn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--max-sessions", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-max", type=int, default=400, help="prompt lengths are drawn from [8, this]")
    ap.add_argument("--no-forks", action="store_true", help="no forks (isolates the clone path)")
    ap.add_argument("--keep", action="store_true", help="the same sessions every round, never closed (steps only)")
    ap.add_argument("--sdp", choices=("default", "no-cudnn", "flash", "efficient", "math"), default="default",
                    help="restrict torch's scaled_dot_product_attention backends")
    ap.add_argument("--max-growth-mib", type=float, default=8.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("memory_churn: no CUDA device\n")
        return 2
    if args.sdp != "default":
        b = torch.backends.cuda
        b.enable_cudnn_sdp(False)
        if args.sdp != "no-cudnn":
            b.enable_flash_sdp(args.sdp == "flash")
            b.enable_mem_efficient_sdp(args.sdp == "efficient")
            b.enable_math_sdp(args.sdp == "math")
    engine = Engine.load(model=args.model, device="cuda", max_sessions=args.max_sessions)
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = [{"round": 0, "tokens": 0, **measure(engine)}]
    print(f"{'round':>5} {'tokens':>7} {'device MiB':>11} {'torch alloc':>12} {'torch resv':>11} {'mapped':>8} "
          f"{'triton':>7} {'stack':>6} {'released':>9}")
    kept = [engine.create_session() for _ in range(args.sessions)] if args.keep else None
    for r in range(1, args.rounds + 1):
        tokens = one_round(engine, rng, args.sessions, args.prompt_max, not args.no_forks, kept)
        row = {"round": r, "tokens": tokens, **measure(engine)}
        engine.release_idle_slots(0.0)
        row["released_device_used_mib"] = measure(engine)["device_used_mib"]
        rows.append(row)
        print(f"{r:>5} {tokens:>7} {row['device_used_mib']:>11.1f} {row['torch_allocated_mib']:>12.1f} "
              f"{row['torch_reserved_mib']:>11.1f} {row['table_mapped_mib']:>8.1f} {row['triton_kernels']:>7.0f} "
              f"{row['stack_bytes']:>6.0f} {row['released_device_used_mib']:>9.1f}", flush=True)
    first = rows[min(2, len(rows) - 1)]
    growth = rows[-1].get("released_device_used_mib", 0.0) - first.get("released_device_used_mib", 0.0)
    outside = (rows[-1]["device_used_mib"] - rows[-1]["table_mapped_mib"]) - (
        first["device_used_mib"] - first["table_mapped_mib"])
    ok = growth <= args.max_growth_mib
    print(f"device memory at zero live sessions, round 2 -> {args.rounds}: {growth:+.1f} MiB with the kept slots "
          f"released ({'ok' if ok else 'GROWS'}, limit {args.max_growth_mib} MiB); {outside:+.1f} MiB outside the "
          f"table with them kept ({rows[-1]['table_mapped_mib']:.1f} MiB mapped for reuse)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "growth_mib": growth, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
