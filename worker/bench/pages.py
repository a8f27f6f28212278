"""Sessions bounded by the tokens they hold, measured: `python -m worker.bench.pages [--json PATH]`.

Five parts, each printed as soon as it is measured (a part that fails prints its error and the others run):

- **live**: `--model` (random:smollm2-135m) at `--max-context` 32768: sessions are opened and given
  `--live-tokens` tokens each (the prompt, then one generated token: real prefill, real pages) until the table
  refuses; how many are live, how many pages each holds, and what the device held. With the default 200 and 75
  tokens: 3 pages and 1 page of 2 MiB each for SmolLM2 (23,040 bytes a token, 80 tokens a page, 16 positions
  mapped ahead of need).
- **decode**: `--decode-sessions` (64) sessions, each a `--prompt-tokens` (128) prompt then `--new-tokens` (256)
  generated, EOS ignored, through the engine's step loop at `--decode-context` (1024, as `client.bench.gpu`),
  output tokens/s; sessions backed page by page against the same run with every slot backed whole at create
  (`ahead_tokens` = max_context), interleaved, medians of `--repeats`.
- **restore**: a session of `--restore-tokens` (2,000) computed tokens hibernated to pinned host memory, then to
  disk (its file dropped from the page cache with posix_fadvise), and restored: the time until its state is back in
  its slot (pages mapped, copy done, stream synchronized).
- **cycles**: `--cycles` (1,000) sessions opened, given 1..2,000 tokens, one token generated, closed; device memory
  (cuMemGetInfo) and the pages held before and after.
- **llama**: `--llama-model` (random:llama3-8b) at `--llama-context` 8192: live sessions of `--llama-tokens` (1,000)
  tokens, as in `live`.

`--parts` picks some; `--device cpu` with a small model (`--model random:tiny ...`) runs the same code on a CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from cuda_state import CapacityExhausted
from worker.engine import Engine, SamplingParams

PARTS = ("live", "decode", "restore", "cycles", "llama")
GIB = 1 << 30
BATCH = 256  # sessions opened and prefilled together while filling the table


def say(text: str) -> None:
    print(text, flush=True)


def device_free(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    return int(free)


def load(model: str, device: str, sessions: int, context: int) -> Engine:
    """The engine, with as many slots as its virtual range allows: halved while the reservation fails."""
    while True:
        try:
            return Engine.load(model, device=device, max_sessions=sessions, max_context=context)
        except CapacityExhausted:
            raise
        except Exception as e:  # noqa: BLE001  (a reservation of too many addresses: fewer slots)
            if "cuMemAddressReserve" not in str(e) or sessions < 1024:
                raise
            say(f"  {sessions} slots of {context} tokens do not fit the virtual address space ({e}); halving")
            sessions //= 2


def run_all(engine: Engine, requests: list[tuple[str, SamplingParams, list[int]]]) -> dict[str, str]:
    """Start every generation (prompt appended by the request), step until all end: finish reason by session."""
    ids: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for sid, params, prompt in requests:
        try:
            ids[engine.start_generate(sid, params, prompt_ids=prompt)] = sid
        except CapacityExhausted:
            reasons[sid] = "refused"
    while engine.has_work():
        for chunk in engine.step():
            if chunk.finish_reason is not None and chunk.request_id in ids:
                reasons[ids[chunk.request_id]] = chunk.finish_reason
    return reasons


def fill(engine: Engine, tokens: int, limit: int, rng: random.Random) -> list[str]:
    """Open sessions of `tokens` tokens (a prompt of tokens - 1, one generated) until the table refuses: the live ones."""
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    live: list[str] = []
    full = False
    while not full and len(live) < limit:
        batch: list[str] = []
        for _ in range(min(BATCH, limit - len(live))):
            try:
                batch.append(engine.create_session())
            except CapacityExhausted:
                full = True
                break
        requests = [(sid, params, [rng.randrange(300, vocab) for _ in range(tokens - 1)]) for sid in batch]
        for sid, reason in run_all(engine, requests).items():
            if reason == "length":
                live.append(sid)
            else:  # no page for its tokens: not a session of `tokens` tokens
                engine.close(sid)
                full = True
    return live


def close_all(engine: Engine) -> None:
    for sid in engine.sessions():
        engine.close(sid)
    engine.release_idle_slots(0.0)


def part_live(engine: Engine, tokens_list: list[int], device: str, out: dict[str, Any]) -> None:
    table = engine.table
    spec, page = table.spec, table.page_bytes
    say(f"live sessions: {engine.model_name}, max_context {engine.max_context}, {table.capacity} slots, "
        f"page budget {table.page_budget} pages of {page / 2**20:g} MiB ({table.page_budget * page / GIB:.1f} GiB), "
        f"{spec.token_bytes} bytes a token, {spec.tokens_in(1, page)} tokens a page, "
        f"{table.ahead_tokens} positions mapped ahead")
    for tokens in tokens_list:
        before = device_free(device)
        start = time.perf_counter()
        live = fill(engine, tokens, table.capacity, random.Random(tokens))
        seconds = time.perf_counter() - start
        pages = {table.pages(engine._sessions[sid].slot) for sid in live}
        after = device_free(device)
        held = None if before is None or after is None else (before - after) / GIB
        need_20k = 20_000 * spec.pages_for(tokens, page) * page / GIB
        row = {"tokens": tokens, "live_sessions": len(live), "pages_each": sorted(pages),
               "pages_held": table.backend.mapped_pages, "device_gib_held": held, "seconds": round(seconds, 1),
               "gib_20000_sessions_would_hold": round(need_20k, 1)}
        out.setdefault("live", []).append(row)
        say(f"  {tokens:>5} tokens: {len(live):>6} live sessions, {sorted(pages)} pages each, "
            f"{table.backend.mapped_pages} pages held"
            + ("" if held is None else f", {held:.1f} GiB of device memory")
            + f" (filled in {seconds:.1f} s; 20,000 such sessions need {need_20k:.0f} GiB)")
        close_all(engine)


def decode_run(engine: Engine, sessions: int, prompt: int, new: int, seed: int) -> float:
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    sids = [engine.create_session() for _ in range(sessions)]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    requests = [(sid, params, [rng.randrange(300, vocab) for _ in range(prompt)]) for sid in sids]
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    reasons = run_all(engine, requests)
    seconds = time.perf_counter() - start
    assert set(reasons.values()) == {"length"}, reasons
    close_all(engine)
    return sessions * new / seconds


def part_decode(engine: Engine, args: argparse.Namespace, out: dict[str, Any]) -> None:
    table = engine.table
    paged_ahead, full_ahead = table.ahead_tokens, engine.max_context
    decode_run(engine, args.decode_sessions, args.prompt_tokens, min(args.new_tokens, 16), 0)  # warm up
    runs: dict[str, list[float]] = {"paged": [], "fully backed": []}
    for rep in range(args.repeats):
        for name, ahead in (("paged", paged_ahead), ("fully backed", full_ahead)):
            table.ahead_tokens = ahead
            runs[name].append(decode_run(engine, args.decode_sessions, args.prompt_tokens, args.new_tokens, rep))
    table.ahead_tokens = paged_ahead
    paged, full = statistics.median(runs["paged"]), statistics.median(runs["fully backed"])
    out["decode"] = {"sessions": args.decode_sessions, "prompt_tokens": args.prompt_tokens,
                     "new_tokens": args.new_tokens, "context": engine.max_context, "runs": runs,
                     "paged_tokens_per_s": paged, "fully_backed_tokens_per_s": full, "paged_over_full": paged / full}
    say(f"decode: {args.decode_sessions} sessions, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
        f"context {engine.max_context}: paged {paged:,.0f} tok/s, fully backed {full:,.0f} tok/s, "
        f"paged / fully backed {paged / full:.3f} (runs: " + "; ".join(
            f"{k} " + ", ".join(f"{v:,.0f}" for v in vs) for k, vs in runs.items()) + ")")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def part_restore(engine: Engine, tokens: int, reps: int, out: dict[str, Any]) -> None:
    vocab = engine.model.config.vocab_size
    rng = random.Random(7)
    store = Path(tempfile.mkdtemp(prefix="pages-bench-"))
    nbytes = engine.table.spec.bytes_for(tokens)
    results: dict[str, Any] = {"tokens": tokens, "bytes": nbytes}
    try:
        engine.enable_hibernation(4 * nbytes, None)
        sid = engine.create_session()
        run_all(engine, [(sid, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                          [rng.randrange(300, vocab) for _ in range(tokens)])])
        assert engine._sessions[sid].computed == tokens, engine._sessions[sid].computed
        host_hibernate, host_restore = [], []
        for _ in range(reps):
            host_hibernate.append(timed(lambda: engine.hibernate(sid)))
            host_restore.append(timed(lambda: engine.restore(sid)))
        engine.enable_hibernation(0, store)
        disk_hibernate, disk_restore = [], []
        for _ in range(max(2, reps // 4)):
            disk_hibernate.append(timed(lambda: engine.hibernate(sid)))
            path = store / (sid + ".session")
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read back from the disk, not the page cache
            finally:
                os.close(fd)
            disk_restore.append(timed(lambda: engine.restore(sid)))
        engine.close(sid)
        engine.release_idle_slots(0.0)
        for name, values in (("host_hibernate", host_hibernate), ("host_restore", host_restore),
                             ("disk_hibernate", disk_hibernate), ("disk_restore", disk_restore)):
            ms = sorted(v * 1e3 for v in values)
            results[name + "_ms"] = {"median": round(statistics.median(ms), 3), "max": round(ms[-1], 3), "runs": len(ms)}
        out["restore"] = results
        say(f"restore: a session of {tokens} tokens ({nbytes / 2**20:.1f} MiB of state): from host memory "
            f"{results['host_restore_ms']['median']:.2f} ms median ({results['host_restore_ms']['max']:.2f} max of "
            f"{reps}); from disk {results['disk_restore_ms']['median']:.1f} ms median; hibernating took "
            f"{results['host_hibernate_ms']['median']:.1f} ms to host, {results['disk_hibernate_ms']['median']:.1f} ms "
            "to disk")
    finally:
        engine.hibernation = None
        for path in store.iterdir():
            path.unlink()
        store.rmdir()


def part_cycles(engine: Engine, cycles: int, max_tokens: int, device: str, out: dict[str, Any]) -> None:
    vocab = engine.model.config.vocab_size
    rng = random.Random(11)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def cycle() -> None:
        sid = engine.create_session()
        run_all(engine, [(sid, params, [rng.randrange(300, vocab) for _ in range(rng.randint(1, max_tokens))])])
        engine.close(sid)

    for _ in range(10):  # first uses (events, driver pools, kernels) before the baseline
        cycle()
    engine.release_idle_slots(0.0)
    before, pages_before = device_free(device), engine.table.backend.mapped_pages
    start = time.perf_counter()
    for _ in range(cycles):
        cycle()
    engine.release_idle_slots(0.0)
    seconds = time.perf_counter() - start
    after, pages_after = device_free(device), engine.table.backend.mapped_pages
    drift = None if before is None or after is None else before - after
    out["cycles"] = {"cycles": cycles, "max_tokens": max_tokens, "device_bytes_drift": drift,
                     "pages_before": pages_before, "pages_after": pages_after, "seconds": round(seconds, 1)}
    say(f"cycles: {cycles} sessions of 1..{max_tokens} tokens opened, grown and closed in {seconds:.1f} s: "
        f"pages held {pages_before} -> {pages_after}"
        + ("" if drift is None else f", device memory {'back to the baseline' if drift == 0 else f'{drift} bytes off'}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.bench.pages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--max-sessions", type=int, default=40_000, help="slots of the live engine (virtual)")
    ap.add_argument("--live-tokens", type=int, nargs="+", default=[200, 75])
    ap.add_argument("--decode-sessions", type=int, default=64)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--restore-tokens", type=int, default=2000)
    ap.add_argument("--restore-repeats", type=int, default=20)
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--cycle-tokens", type=int, default=2000)
    ap.add_argument("--llama-model", default="random:llama3-8b")
    ap.add_argument("--llama-context", type=int, default=8192)
    ap.add_argument("--llama-sessions", type=int, default=1000)
    ap.add_argument("--llama-tokens", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"}
    say(f"device: {out['device']}")
    failed = 0

    def part(name: str, fn: Callable[[], None]) -> None:
        nonlocal failed
        if name not in args.parts:
            return
        try:
            fn()
        except Exception:  # noqa: BLE001  (one part's failure is reported; the others still run)
            failed += 1
            out.setdefault("errors", {})[name] = traceback.format_exc()
            say(f"{name}: FAILED\n{traceback.format_exc()}")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))

    if {"live", "restore", "cycles"} & set(args.parts):
        engine = load(args.model, args.device, args.max_sessions, args.max_context)
        part("live", lambda: part_live(engine, args.live_tokens, args.device, out))
        part("restore", lambda: part_restore(engine, args.restore_tokens, args.restore_repeats, out))
        part("cycles", lambda: part_cycles(engine, args.cycles, min(args.cycle_tokens, args.max_context - 2),
                                           args.device, out))
        engine.unload()
    if "decode" in args.parts:
        engine = Engine.load(args.model, device=args.device, max_sessions=args.decode_sessions,
                             max_context=args.decode_context)
        part("decode", lambda: part_decode(engine, args, out))
        engine.unload()
    if "llama" in args.parts:
        def llama() -> None:
            engine = load(args.llama_model, args.device, args.llama_sessions, args.llama_context)
            try:
                part_live(engine, [args.llama_tokens], args.device, out)
                out["llama"] = out["live"].pop()
            finally:
                engine.unload()

        part("llama", llama)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
