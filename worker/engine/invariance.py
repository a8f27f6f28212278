"""The start-up check that a GPU executor's buckets give every row the same bits (worker.engine.graphs).

A session's tokens must not depend on what else is in its step. Whether rows come out the same in every
bucket is measured, not assumed: each smaller decode bucket replays real rows (random K/V in real slots)
beside the largest one, in both its graphs, and a bucket whose logits differ in any bit is dropped, its
batches served by the next larger bucket; short rows are checked to come out the same from the split and
the unsplit attention; prefill buckets are checked against the largest prefill bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import structlog
import torch

from cuda_state import SessionTable, StateError
from worker.model.batch import Run
from worker.model.llama import Llama

log = structlog.get_logger(__name__)

INVARIANCE_CHECK_POSITIONS = 48  # positions of random K/V the check's rows attend to
INVARIANCE_CHECK_CHUNKS = 4  # prompt chunks (one per temporary slot) the check puts in each prefill bucket


class Replays(Protocol):
    """What the check needs of an executor (worker.engine.graphs.GraphExecutor): its buckets, padded replays of
    given rows in a chosen bucket, and a way to drop buckets."""

    model: Llama
    table: SessionTable
    state: dict[str, torch.Tensor]
    buckets: list[int]
    prefill_buckets: list[int]
    prefill_rows: int
    prefill_logits: int
    long_rows_from: int | None

    def replay_decode(self, tokens: list[int], positions: list[int], slots: list[int],
                      source: tuple[torch.Tensor, list[int]] | None = None, copy_logits: bool = True,
                      bucket: int | None = None, long: bool | None = None) -> torch.Tensor: ...

    def replay_prefill(self, runs: list[Run], tokens: list[int], positions: list[int], wanted: set[int],
                       bucket: int | None = None) -> tuple[list[int], torch.Tensor]: ...

    def drop_buckets(self, decode: list[int], prefill: list[int]) -> None: ...


def keep_row_invariant_buckets(ex: Replays) -> None:
    """Drop every bucket whose rows differ in any bit from the same rows run in the largest bucket,
    decode and prefill buckets alike.

    Real rows: temporary slots with random K/V in their first positions; decode rows are random
    tokens at random positions there, prefill chunks random tokens from random offsets there. So the
    products, the attention and the head all see ordinary numbers. A library that picks another
    reduction order for another row count shows up in the logits; the bucket's batches then run in
    the next larger one (slower, never different).
    """
    if len(ex.buckets) == 1 and len(ex.prefill_buckets) == 1 and ex.long_rows_from is None:
        return
    start = time.perf_counter()
    gen = torch.Generator(device=ex.model.device).manual_seed(0)
    slots: list[int] = []
    dropped: list[int] = []
    dropped_prefill: list[int] = []
    try:
        wanted = max(ex.buckets[-2] if len(ex.buckets) > 1 else 0, INVARIANCE_CHECK_CHUNKS)
        span = min(INVARIANCE_CHECK_POSITIONS, ex.model.max_context - 1)
        filled = min(span + (ex.long_rows_from or 0), ex.model.max_context - 1)  # long rows reach past span
        for _ in range(min(wanted, ex.table.capacity)):
            slots.append(ex.table.create(filled + 1))  # backed for every position the check's rows reach
        spec = ex.table.spec
        for buf in spec.buffers:
            view = ex.state[buf.name]
            for slot in slots:  # a growing buffer: its first blocks, through position filled - 1
                part = view[slot] if buf.seq_axis is None else view[slot].narrow(buf.seq_axis, 0, -(-filled // spec.block))
                part.copy_(torch.randn(part.shape, generator=gen, device=part.device, dtype=torch.float32))
        restore = _restorer(ex, slots)
        if ex.long_rows_from is not None and not _split_graphs_agree(ex, slots, gen, restore):
            log.warning("split_attention_differs", detail="short rows differ between the two attentions: every "
                        "step takes the split one", long_rows_from=ex.long_rows_from)
            ex.long_rows_from = 1  # every row: every step replays the split graphs
        short = ex.long_rows_from != 1  # the graphs without split attention serve steps
        split = ex.long_rows_from is not None  # each bucket's split graph too, rows long and short
        dropped = [b for b in ex.buckets[:-1] if short and not _decode_invariant(ex, b, slots, span, gen, restore)
                   or split and not _decode_invariant(ex, b, slots, filled, gen, restore, long=True)]
        dropped_prefill = [b for b in ex.prefill_buckets[:-1]
                           if not _prefill_invariant(ex, b, slots, span, gen, restore)]
    except StateError as e:  # no room for the check's slots: keep only the largest buckets
        log.warning("buckets_unchecked", error=str(e), kept=[ex.buckets[-1]], prefill_kept=[ex.prefill_rows])
        dropped, dropped_prefill = ex.buckets[:-1], ex.prefill_buckets[:-1]
        if ex.long_rows_from is not None:  # the two attentions' agreement unchecked: the split one only
            ex.long_rows_from = 1
    finally:
        for slot in slots:
            ex.table.free(slot)
        ex.table.trim()  # the check's slots are not kept mapped for sessions
    ex.drop_buckets(dropped, dropped_prefill)
    torch.cuda.empty_cache()  # the check's temporaries: nothing of it stays on the device
    if dropped or dropped_prefill:
        log.warning("buckets_not_row_invariant", dropped=dropped, kept=ex.buckets,
                    prefill_dropped=dropped_prefill, prefill_kept=ex.prefill_buckets,
                    detail="their matrix products sum in another order than the largest bucket's")
    log.info("buckets_checked", buckets=ex.buckets, prefill_buckets=ex.prefill_buckets,
             seconds=round(time.perf_counter() - start, 3))


def _restorer(ex: Replays, slots: list[int]) -> Callable[[], None]:
    """What gives the check's slots their first random state back, called before each replay. A state without a
    sequence axis (a hybrid model's recurrent state) is advanced by every replay, unlike K/V, which a replay rewrites
    in place: restored, the same rows meet the same state in every bucket."""
    index = torch.tensor(slots, device=ex.model.device)
    saved = [(ex.state[b.name], ex.state[b.name][index].clone()) for b in ex.table.spec.buffers if b.seq_axis is None]

    def restore() -> None:
        for view, first in saved:
            view[index] = first

    return restore


def _decode_invariant(ex: Replays, b: int, slots: list[int], span: int, gen: torch.Generator,
                      restore: Callable[[], None], long: bool = False) -> bool:
    """b decode rows (b <= len(slots)) at positions below `span` give the same logits in bucket b as in the
    largest bucket (long: in the split attention's graphs)."""
    vocab, device = ex.model.config.vocab_size, ex.model.device
    tokens = torch.randint(0, vocab, (b,), generator=gen, device=device).tolist()
    positions = torch.randint(1, span, (b,), generator=gen, device=device).tolist()
    if long and ex.long_rows_from is not None and span > ex.long_rows_from:  # a row that splits, at least
        positions[0] = int(torch.randint(ex.long_rows_from - 1, span, (), generator=gen, device=device))
    restore()
    wide = ex.replay_decode(tokens, positions, slots[:b], bucket=ex.buckets[-1], long=long)
    restore()
    own = ex.replay_decode(tokens, positions, slots[:b], bucket=b, long=long)
    return torch.equal(wide, own)


def _split_graphs_agree(ex: Replays, slots: list[int], gen: torch.Generator, restore: Callable[[], None]) -> bool:
    """Rows shorter than long_rows_from give the same logits in the split attention's graph as in the other
    (what lets a step's longest row pick the graph without moving the others' numbers)."""
    assert ex.long_rows_from is not None
    vocab, device = ex.model.config.vocab_size, ex.model.device
    rows = min(len(slots), ex.buckets[-1])
    tokens = torch.randint(0, vocab, (rows,), generator=gen, device=device).tolist()
    positions = torch.randint(1, ex.long_rows_from - 1, (rows,), generator=gen, device=device).tolist()
    restore()
    split = ex.replay_decode(tokens, positions, slots[:rows], bucket=ex.buckets[-1], long=True)
    restore()
    return torch.equal(split, ex.replay_decode(tokens, positions, slots[:rows], bucket=ex.buckets[-1], long=False))


def _prefill_invariant(ex: Replays, b: int, slots: list[int], span: int, gen: torch.Generator,
                       restore: Callable[[], None]) -> bool:
    """Prompt chunks filling most of b rows, one per slot from a random offset, give the same logits at
    their ends in prefill bucket b as in the largest one."""
    vocab, device = ex.model.config.vocab_size, ex.model.device
    slots = slots[: min(INVARIANCE_CHECK_CHUNKS, ex.prefill_logits)]  # one replay's chunks at most
    offsets = torch.randint(0, span, (len(slots),), generator=gen, device=device).tolist()
    lengths = [max(2, min(b // len(slots), ex.model.max_context - o)) for o in offsets]
    runs: list[Run] = []
    positions: list[int] = []
    for slot, offset, n in zip(slots, offsets, lengths, strict=True):
        runs.append(Run(slot=slot, start=len(positions), n=n, pos=offset))
        positions += range(offset, offset + n)
    for run in runs:  # a chunk may reach past what the slot was backed for: map its pages first
        ex.table.ensure(run.slot, run.pos + run.n)
    tokens = torch.randint(0, vocab, (len(positions),), generator=gen, device=device).tolist()
    ends = {run.start + run.n - 1 for run in runs}
    restore()
    _, wide = ex.replay_prefill(runs, tokens, positions, ends, bucket=ex.prefill_rows)
    wide = wide.clone()
    restore()
    _, own = ex.replay_prefill(runs, tokens, positions, ends, bucket=b)
    return torch.equal(wide, own)
