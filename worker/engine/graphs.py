"""The GPU side of the engine: the Triton attention kernels, workspace sizing and CUDA-graph steps.

Every GPU step replays a captured CUDA graph. State lives at fixed addresses in the slab and the model
indexes it by slot, so only small static input tensors change between replays. Each row of a step is
one token: its id, its position, its session's slot, and the length of that session's prefix it
attends to (position + 1). Attention reads K/V in place from the slab, after the step has written its
own tokens' K/V, so a prompt chunk's rows attend causally within the chunk exactly as a decode row
attends to its history. Decode rows take worker.kernels.attention's kernel, one program per row and KV
head; prompt chunks take worker.kernels.prefill's, whose programs serve tiles of up to 64 of a chunk's
rows and load each K/V block once for them (the tiles, worker.kernels.tiles, are static inputs of the
prefill graphs like the rows; WORKER_PREFILL_TILES=0 gives prompt rows the decode kernel, for A/B runs).

- Decode rows (one token of each generating session) replay a graph per batch-size bucket.
- Prompt chunks of a step are packed into one prefill graph, the smallest of PREFILL_BUCKETS rows
  that holds them, returning logits only at the chunk ends (at most PREFILL_LOGITS chunks per replay;
  more chunks take more replays). A lone 128-token prompt runs 128 rows, not the step budget's 2048.
Padding rows point at the table's spare slot (always mapped) at position 0 with length 1, so a padded
row reads and writes only memory nobody else uses.

Decode steps run their products in worker.kernels.matmul's kernels (row_products; the norms' weights
folded into the products, worker.model.llama.Layer): 6 launches per layer with the norms, the activation and
the residual adds fused in, against 9 with cuBLAS (one more each when the attention splits the keys).
Prefill steps keep cuBLAS: at hundreds of rows its wide tiles win. WORKER_ROW_PRODUCTS=0 gives decode
steps cuBLAS too (for A/B runs). On Hopper and later the Triton kernels launch with programmatic dependent
launch (worker.kernels.pdl), which hides most of the gap between a graph's consecutive kernels.

Batch invariance: a row's numbers must not depend on what else is in the step (the same seed and
inputs give the same tokens whatever else runs). Every kernel of a decode step works row by row:
the row products' tiles depend on the weight's shape only, and the attention's split count
(programs per row's keys) is pinned for every bucket, each row taking as many splits as its own
length fills. Each decode bucket has two graphs, one without split attention for steps whose rows are
all shorter than long_rows_from (a row that short runs in one split either way, the same bits), the
other for the rest. (cuBLAS, for prefill, picks a kernel by the shape.) Whether rows come out the
same in every bucket is measured, not assumed: at start-up each smaller bucket replays real rows
(random K/V in real slots) beside the largest one, in both its graphs, and a bucket whose logits
differ in any bit is dropped, its batches served by the next larger bucket (on the H100 every bucket
passes: one session runs a 1-row step instead of a 64-row one); short rows are checked to come out
the same from both graphs (if not, every step takes the split one).
Prefill buckets are checked the same way against the largest prefill bucket (prompt chunks at
random offsets of the same temporary slots). A prompt row's attention does not depend on its tile:
key blocks start at position 0 whatever the tile, and a block past a row's length changes nothing of
that row (worker.kernels.prefill), so a prompt's chunks of 2 or more tokens give the same bits however
they are tiled and packed, whatever shares the step. (A 1-token chunk is a decode row; the engine
cuts a session's prompt into chunks by its own length and the step budget, never by its neighbours.)
A step that mixes decode rows and prompt chunks is split that way: decode rows from their bucket's
graph, the chunks from a prefill graph.

A step's first decode rows can take their token ids from a device tensor (the previous step's sampled
ids): the engine launches the next step before it has read the last one's tokens (worker.engine).
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable

import numpy as np
import structlog
import torch

from cuda_state import SessionTable
from worker.engine.budget import GPU_STEP_TOKENS
from worker.engine.executor import StepRows
from worker.engine.invariance import keep_row_invariant_buckets
from worker.kernels.tiles import max_tiles, prefill_tiles
from worker.model.batch import Batch, Run, runs_of
from worker.model.llama import Llama

log = structlog.get_logger(__name__)

# Decode batch sizes captured as graphs; larger batches are cut. Each graph keeps its logits (rows x vocab, fp32):
# steps of 4x in rows keep that memory small while padding costs little (below ~64 rows a step's time hardly
# depends on its rows on a model this size; a single session gets its own 1-row step).
BUCKETS = (1, 4, 16, 64, 128, 256)
WARMUP_RUNS = 2  # eager runs on the capture stream before capturing (compiles Triton, inits cuBLAS)
PREFILL_ROWS = GPU_STEP_TOKENS  # rows of the largest prefill replay: the engine's GPU step budget for prompt tokens
# Prefill graphs' rows below PREFILL_ROWS. They share the largest one's activation blocks and its logits output,
# so each costs only its capture: a few sessions' prompts pad to at most twice their tokens.
PREFILL_BUCKETS = (128, 256, 512, 1024)
PREFILL_LOGITS = 64  # chunk ends one prefill replay returns logits for (fixed: the lm_head's shape)
# Decode attention's split count, pinned for all buckets, is at most this; a row takes fewer when its length gives
# each split under MIN_SPLIT_KEYS keys (triton_attention). One session's 3 (row, kv head) programs each walking
# all its keys cost the most at long lengths; short rows gain nothing from splitting and a 64-row step's 192
# programs fill the GPU. H100, SmolLM2-135M, 1-row / 64-row step: 1,000 keys 0.922 / 1.314 ms with 1 split,
# 0.800 / 1.406 with 2; 1,800 keys 1.175 / 1.730 and 0.936 / 1.864; 7,000 keys (1 row) 2.736 and 1.717; under
# 512 keys a step without the split kernel and its merge: 0.665 / 0.817 against 0.676 / 0.853 (why each decode
# bucket has a second graph, for steps whose longest row splits).
PINNED_SPLITS_MAX = 2


def buckets_for(capacity: int) -> list[int]:
    """BUCKETS up to the table's capacity, plus the capacity itself when it falls between two."""
    if capacity >= BUCKETS[-1]:
        return list(BUCKETS)
    return [b for b in BUCKETS if b < capacity] + [capacity]


def prefill_buckets_for(rows: int) -> list[int]:
    """PREFILL_BUCKETS below `rows` (the largest prefill replay), then `rows`."""
    return [b for b in PREFILL_BUCKETS if b < rows] + [rows]


def pick_bucket(buckets: list[int], rows: int) -> int:
    """The smallest bucket (sorted ascending) that holds `rows` rows (1 <= rows <= buckets[-1])."""
    return buckets[bisect.bisect_left(buckets, rows)]


def split_step(tokens: list[int], positions: list[int], slots: list[int]) -> tuple[list[int], list[Run]]:
    """Flat batch -> (rows of single-token runs: the decode rows, prefill runs of several tokens)."""
    decode: list[int] = []
    prefill: list[Run] = []
    for run in runs_of(slots, positions):
        if run.n == 1:
            decode.append(run.start)
        else:
            prefill.append(run)
    return decode, prefill


def _into(out: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """`logits` written into another graph's output `out` (graphs sharing one output), or themselves (None)."""
    if out is None:
        return logits
    with torch.inference_mode():  # the output, like the forward's tensors, is an inference tensor
        return out.copy_(logits)


class StaticInputs:
    """A (fields, rows) int64 block the graphs read, loaded from a pinned host twin without a host sync.

    Columns start as `padding`. load() writes the host twin and queues its copy; the twin is
    rewritten only once the previous copy has read it (an event), so two steps in flight are safe.
    """

    def __init__(self, rows: int, padding: np.ndarray, device: torch.device) -> None:
        self.padding = padding  # (fields, 1): the value of every field in a padding column
        self._host = torch.zeros((padding.shape[0], rows), dtype=torch.long).pin_memory()
        self.host: np.ndarray = self._host.numpy()
        self.host[:] = padding
        self.device: torch.Tensor = self._host.to(device)  # static: graphs read it
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(device))

    def begin(self) -> np.ndarray:
        """The host twin, free to write: the last copy has read it."""
        self._copied.synchronize()
        return self.host

    def load(self) -> None:
        self.device.copy_(self._host, non_blocking=True)
        # The stream named by its device: current_stream() without one looks the device up (with the engine's event
        # record, 3% of the worker's compute loop at 64 sessions on the H100).
        self._copied.record(torch.cuda.current_stream(self.device.device))


class GraphExecutor:
    """Every step from CUDA graphs: decode rows by bucket, prompt chunks in the fixed-shape prefill graph.

    With use_graphs=False the same padded steps run eagerly (the same kernels and shapes, so the same
    numbers): the switch changes launch overhead only.
    """

    overlaps = True  # decode steps take their token ids from a device tensor: the engine may run ahead

    def __init__(
        self,
        model: Llama,
        table: SessionTable,
        buckets: list[int] | None = None,
        use_graphs: bool = True,
        prefill_rows: int = PREFILL_ROWS,
        prefill_logits: int = PREFILL_LOGITS,
        row_products: bool = True,
        attention_splits: int | None = None,
    ) -> None:
        """`row_products`: decode steps' products in worker.kernels.matmul's kernels, where the model has the fused
        layer stack and its norms folded (EngineOptions.row_products). `attention_splits`: the decode attention's
        split count pinned for every bucket (None: chosen from the shapes, see pin_splits)."""
        if model.kernels.decode_attention is None:
            raise ValueError("GraphExecutor needs a model built with the decode kernel (worker.kernels.gpu_kernels)")
        # torch's cuDNN attention backend builds, and keeps, an execution plan holding device memory outside
        # torch's allocator for every new (length, ...) shape. Prompt lengths rarely repeat, so a serving worker's
        # memory grew without end (~3 MiB per 40 prompts, worker/bench/memory_churn.py); without it, it stays flat.
        # (Only eager forwards use torch's attention now; graphs use the slab kernels.)
        torch.backends.cuda.enable_cudnn_sdp(False)
        self.model: Llama = model
        self.table: SessionTable = table
        self.state: dict[str, torch.Tensor] = table.views()
        self.buckets: list[int] = sorted(buckets or buckets_for(table.capacity))
        self.replays: int = 0  # decode steps served by a graph (for tests and metrics)
        self.prefill_replays: int = 0  # prefill forwards served by the graph
        device = model.device
        # Rows: token ids, positions, slots, lengths. Padding columns: token 0 at position 0 of the spare.
        self._padding: np.ndarray = np.array([[0], [0], [table.spare_slot], [1]], dtype=np.int64)
        self._decode_in = StaticInputs(self.buckets[-1], self._padding, device)
        self._in_order: list[int] = list(range(self.buckets[-1]))
        self._id_rows: list[torch.Tensor] = [self._decode_in.device[0, :k] for k in range(self.buckets[-1] + 1)]  # views
        # The prefill graphs' rows, plus a fifth row whose first prefill_logits entries pick the chunk ends, and two
        # more for the attention's tiles (worker.kernels.prefill): each one's first row and row count (0: unused).
        self.prefill_rows: int = prefill_rows
        self.prefill_buckets: list[int] = prefill_buckets_for(prefill_rows)
        self.prefill_logits: int = min(prefill_logits, self.prefill_buckets[0])  # also the most chunks in a replay
        self._prefill_in = StaticInputs(prefill_rows, np.vstack([self._padding, [[0]], [[0]], [[0]]]), device)
        self._prefill_out: torch.Tensor | None = None  # the largest prefill graph's logits: every prefill graph's output
        self._stream: torch.cuda.Stream = torch.cuda.Stream(device)
        self.use_graphs: bool = use_graphs
        # Decode steps' products in worker.kernels.matmul's fused kernels (with the fused layer stack on). They need
        # the norms' weights in the products (Llama(fold_norms=True), as Engine.load builds it for this option).
        self.row_products: bool = row_products and model.takes_row_products
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # The same buckets with split attention, for steps with a row of long_rows_from keys or more (see _decode).
        self._long_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # A step with a row of this many keys or more replays the split graphs (1: every step). None: one graph per
        # bucket (attention not split, or no row long enough to split).
        self.long_rows_from: int | None = None
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.attention_splits: int | None = None  # the smallest bucket's, for every bucket (None: off the GPU)
        # Without the tiled prompt attention, prompt rows take the decode kernel, its split count pinned likewise.
        self.prefill_splits: int | None = None
        if device.type == "cuda":
            self._pin_splits(attention_splits)
        if use_graphs:
            self._capture_graphs()
        if device.type == "cuda":
            keep_row_invariant_buckets(self)

    def _pin_splits(self, pinned: int | None) -> None:
        """The decode attention's split count for every bucket (a row's attention must sum in the same order in any
        bucket): what the smallest bucket wants, at most PINNED_SPLITS_MAX (see there), or `pinned`; and the length
        from which a row splits (long_rows_from: the steps whose rows are all shorter take the unsplit graphs)."""
        from worker.kernels.attention import MIN_SPLIT_KEYS, num_splits, sm_count

        model = self.model
        c, sms = model.config, sm_count(model.device)
        self.attention_splits = min(num_splits(self.buckets[0], c.n_kv_heads, model.max_context, sms), PINNED_SPLITS_MAX)
        if pinned is not None:
            self.attention_splits = pinned
            log.info("attention_splits_pinned", splits=pinned)
        self.prefill_splits = num_splits(self.prefill_rows, c.n_kv_heads, model.max_context, sms)
        if self.attention_splits > 1 and model.max_context >= 2 * MIN_SPLIT_KEYS:
            self.long_rows_from = 2 * MIN_SPLIT_KEYS

    def _capture_graphs(self) -> None:
        """The prefill graphs, largest first (the later ones reuse its pool blocks; only outputs stay), then each decode
        bucket's graph and, where rows split, its split-attention twin."""
        start = time.perf_counter()
        for b in reversed(self.prefill_buckets):
            self._prefill_graphs[b], logits = self._capture(functools.partial(self._prefill_forward, b))
            if self._prefill_out is None:
                self._prefill_out = logits  # the smaller prefill graphs copy their logits into it
        for b in reversed(self.buckets):
            self._graphs[b] = self._capture(functools.partial(self._decode_forward, b))
            if self.long_rows_from is not None:  # writes its logits into the short graph's output
                self._long_graphs[b], _ = self._capture(functools.partial(self._decode_forward, b, True))
        torch.cuda.synchronize(self.model.device)
        log.info("cuda_graphs_captured", buckets=self.buckets, prefill_buckets=self.prefill_buckets,
                 seconds=round(time.perf_counter() - start, 2))

    def drop_buckets(self, decode: list[int], prefill: list[int]) -> None:
        """Serve no step from these buckets (the start-up check found their rows differ): their batches take the next
        larger bucket. The replay counters start afresh."""
        for b in decode:
            self.buckets.remove(b)
            self._graphs.pop(b, None)
            self._long_graphs.pop(b, None)
        for b in prefill:
            self.prefill_buckets.remove(b)
            self._prefill_graphs.pop(b, None)
        self.replays = self.prefill_replays = 0

    @property
    def max_decode_rows(self) -> int:
        """The most decode rows one replay serves."""
        return self.buckets[-1]

    def execute(self, rows: StepRows, copy_logits: bool = True) -> torch.Tensor:
        """Logits (len(rows.logits_at), vocab) fp32 (see Executor.execute). With `rows.source`, a step's decode rows
        fit one replay (at most max_decode_rows)."""
        tokens, positions, slots, logits_at, source = rows
        n = len(positions)
        if n <= self.buckets[-1] and len(set(slots)) == n and logits_at == list(range(n)):
            # The common case: every row a different session's one token (prompt chunks share a slot), one replay.
            return self.replay_decode(tokens, positions, slots, source, copy_logits)
        decode, prefill = split_step(tokens, positions, slots)
        if source is not None and (len(decode) > self.buckets[-1] or decode[: len(source[1])] != list(range(len(source[1])))):
            raise ValueError("token ids from the device serve the first rows of a step's one decode replay")
        wanted = set(logits_at)
        kept: dict[int, torch.Tensor] = {}
        biggest = self.buckets[-1]
        for i in range(0, len(decode), biggest):
            part = decode[i : i + biggest]
            logits = self.replay_decode([tokens[r] for r in part], [positions[r] for r in part],
                                        [slots[r] for r in part], source)
            kept.update((r, logits[j]) for j, r in enumerate(part) if r in wanted)
        missing = wanted.difference(decode, (run.start + run.n - 1 for run in prefill))
        if missing:
            raise ValueError(f"logits of prefill rows {sorted(missing)} other than a chunk's last are not kept")
        groups = self._prefill_groups(prefill)
        for i, group in enumerate(groups):
            keys, logits = self.replay_prefill(group, tokens, positions, wanted)
            if i + 1 < len(groups):
                logits = logits.clone()  # the next prefill replay rewrites the graphs' output
            kept.update(zip(keys, logits, strict=True))
        return torch.stack([kept[r] for r in logits_at]) if logits_at else torch.empty(
            (0, self.model.config.vocab_size), dtype=torch.float32, device=self.model.device
        )

    def _prefill_groups(self, runs: list[Run]) -> list[list[Run]]:
        """Prefill runs packed in order into replays of at most `prefill_rows` rows and `prefill_logits` runs (each
        replay returns the logits of up to that many chunk ends, and its attention has tiles for that many chunks)."""
        if any(run.n > self.prefill_rows for run in runs):
            raise ValueError(f"a prompt chunk is longer than the {self.prefill_rows} rows of a prefill step")
        groups: list[list[Run]] = []
        size = self.prefill_rows + 1
        for run in runs:
            if size + run.n > self.prefill_rows or len(groups[-1]) == self.prefill_logits:
                groups.append([])
                size = 0
            groups[-1].append(run)
            size += run.n
        return groups

    def replay_prefill(
        self, runs: list[Run], tokens: list[int], positions: list[int], wanted: set[int], bucket: int | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """One prefill replay over several sessions' chunks, padded to the smallest prefill bucket that holds
        them (or `bucket`). Returns the caller's row of each chunk end in `wanted` and those rows' logits: a
        view of the graphs' output, which the next prefill replay rewrites.

        Every prefill bucket's rows are row-invariant with the largest's (checked at start-up), and each row
        attends to its own session's prefix only, so a chunk's numbers do not depend on its neighbours or
        on the bucket. Padding rows write K/V at position 0 of the spare slot and read only that.
        """
        size = sum(run.n for run in runs)
        if len(runs) > self.prefill_logits or size > self.prefill_rows:
            raise ValueError(f"{len(runs)} chunks of {size} rows: one prefill replay takes {self.prefill_logits} "
                             f"chunks of {self.prefill_rows} rows at most")
        bucket = pick_bucket(self.prefill_buckets, size) if bucket is None else bucket
        host = self._prefill_in.begin()
        host[:, :bucket] = self._prefill_in.padding
        keys: list[int] = []  # the caller's row of each chunk end, in the order of the logits
        starts: list[int] = []  # each chunk's first row here
        cursor = 0
        ids, at = np.array(tokens, dtype=np.int64), np.array(positions, dtype=np.int64)  # once: slices copy from them
        for run in runs:
            end = run.start + run.n
            host[0, cursor : cursor + run.n] = ids[run.start : end]
            host[1, cursor : cursor + run.n] = at[run.start : end]
            host[2, cursor : cursor + run.n] = run.slot
            if end - 1 in wanted:
                host[4, len(keys)] = cursor + run.n - 1
                keys.append(end - 1)
            starts.append(cursor)
            cursor += run.n
        host[3, :cursor] = host[1, :cursor] + 1
        # The attention's tiles: each chunk's rows, then the padding rows (all in the spare slot).
        firsts, counts = prefill_tiles([*starts, cursor], [run.n for run in runs] + [bucket - cursor])
        host[5, : len(firsts)] = firsts
        host[6, : len(firsts)] = counts
        self._prefill_in.load()
        if self.use_graphs:
            self._prefill_graphs[bucket].replay()
            assert self._prefill_out is not None
            logits = self._prefill_out
            self.prefill_replays += 1
        else:
            logits = self._prefill_forward(bucket)
        self.table.mark_used(sorted({r.slot for r in runs}))
        return keys, logits[: len(keys)]

    def replay_decode(
        self, tokens: list[int], positions: list[int], slots: list[int], source: tuple[torch.Tensor, list[int]] | None = None,
        copy_logits: bool = True, bucket: int | None = None, long: bool | None = None,
    ) -> torch.Tensor:
        """One padded decode step over distinct sessions' single tokens: logits (n, vocab), a copy unless
        copy_logits is False. With `source` (ids, picks), row i < len(picks) takes ids[picks[i]], gathered on the
        device. `bucket`: the batch size to run (default: the smallest that holds the rows). `long`: the split
        attention's graph (default: when a row attends to long_rows_from keys or more; both give a shorter row
        the same bits, so the choice moves no row's numbers)."""
        n = len(positions)
        bucket = pick_bucket(self.buckets, n) if bucket is None else bucket
        if long is None:
            long = self.long_rows_from is not None and max(positions, default=0) + 1 >= self.long_rows_from
        host = self._decode_in.begin()
        host[0, :n] = tokens
        host[1, :n] = positions
        host[2, :n] = slots
        host[3, :n] = host[1, :n] + 1
        host[:, n:] = self._padding
        samples, picks = source if source is not None else (None, [])
        k = len(picks)
        # Steady decoding: row i takes the last step's i-th sample (the same requests in the same order), one copy.
        # Otherwise the picks travel in the ids' place and are swapped for the ids on the device (a gather and a copy).
        in_order = picks == self._in_order[:k]
        if k and not in_order:
            host[0, :k] = picks
        self._decode_in.load()
        if samples is not None and k:
            ids = self._id_rows[k]
            ids.copy_(samples[:k] if in_order else samples.index_select(0, ids))
        if self.use_graphs:
            graph, logits = self._graphs[bucket]
            (self._long_graphs[bucket] if long else graph).replay()
            self.replays += 1
        else:
            logits = self._decode_forward(bucket, long)
        self.table.mark_used(slots)  # one row per session: distinct
        return logits[:n].clone() if copy_logits else logits[:n]

    # -- steps ----------------------------------------------------------------------------------

    def _decode_forward(self, b: int, long: bool = False) -> torch.Tensor:
        """The decode forward over the first b static rows: logits (b, vocab) fp32.

        long False with long_rows_from set: attention in one program per (row, KV head), for steps whose rows are
        all shorter than long_rows_from (no merge kernel). long True: keys split attention_splits ways, each row as
        its length wants (triton_attention: rows shorter than long_rows_from in one split, the same bits), the
        logits written into the short graph's output once that exists."""
        tokens, positions, slots, lengths = self._decode_in.device[:, :b]
        splits = self.attention_splits if long or self.long_rows_from is None else 1
        batch = Batch(runs=[], decode_only=True, lengths=lengths.to(torch.int32),
                      attention_splits=splits, row_products=self.row_products, rope_in_attention=splits == 1)
        logits = self.model.forward(tokens, positions, slots, self.state, batch)
        short = self._graphs.get(b)
        return _into(short[1] if long and short is not None else None, logits)

    def _prefill_forward(self, b: int) -> torch.Tensor:
        """The prefill forward over the first b static prefill rows: logits (prefill_logits, vocab) fp32,
        written into the largest prefill graph's output once that exists (graphs).

        Every row is a query of its own session at its position, its attention from the slab by slot and length:
        the tiled prompt kernel's (or with PREFILL_TILES_ENV "0" the decode kernel's, `decode_only`); logits only at
        the chunk ends."""
        tokens, positions, slots, lengths, ends, _, _ = self._prefill_in.device[:, :b]
        tiles = self._prefill_in.device[5:, : max_tiles(b, self.prefill_logits)]
        # The tiles always: without the tiled attention kernel the attention takes the decode kernel, and a hybrid
        # model's DeltaNet layers find the chunks' runs in them.
        batch = Batch(runs=[], decode_only=True, lengths=lengths.to(torch.int32), attention_splits=self.prefill_splits,
                      tiles=tiles)
        logits = self.model.forward(tokens, positions, slots, self.state, batch, ends[: self.prefill_logits])
        return _into(self._prefill_out, logits)

    def _capture(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on the capture stream, then capture. Static inputs hold padding: only the spare is touched."""
        current = torch.cuda.current_stream(self.model.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for _ in range(WARMUP_RUNS):
                step()
        current.wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            logits = step()
        return graph, logits
