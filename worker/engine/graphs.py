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
import os
import time
from collections.abc import Callable

import numpy as np
import structlog
import torch

from cuda_state import SessionTable, StateError
from worker.engine.executor import Executor
from worker.kernels.tiles import max_tiles, prefill_tiles
from worker.model.llama import Batch, Llama, Run, runs_of

log = structlog.get_logger(__name__)

# Decode batch sizes captured as graphs; larger batches are cut. Each graph keeps its logits (rows x vocab, fp32):
# steps of 4x in rows keep that memory small while padding costs little (below ~64 rows a step's time hardly
# depends on its rows on a model this size; a single session gets its own 1-row step).
BUCKETS = (1, 4, 16, 64, 128, 256)
INVARIANCE_CHECK_POSITIONS = 48  # positions of random K/V the start-up check's rows attend to
WARMUP_RUNS = 2  # eager runs on the capture stream before capturing (compiles Triton, inits cuBLAS)
PREFILL_ROWS = 2048  # rows of the largest prefill replay (= the engine's GPU step budget for prompt tokens)
# Prefill graphs' rows below PREFILL_ROWS. They share the largest one's activation blocks and its logits output,
# so each costs only its capture: a few sessions' prompts pad to at most twice their tokens.
PREFILL_BUCKETS = (128, 256, 512, 1024)
PREFILL_LOGITS = 64  # chunk ends one prefill replay returns logits for (fixed: the lm_head's shape)
INVARIANCE_CHECK_CHUNKS = 4  # prompt chunks (one per temporary slot) the start-up check puts in each prefill bucket
GRAPHS_ENV = "WORKER_CUDA_GRAPHS"  # "0" disables graphs whatever the caller asked for
FUSED_ENV = "WORKER_FUSED_KERNELS"  # "0" keeps the plain torch layer loop on the GPU (A/B comparisons)
ROW_PRODUCTS_ENV = "WORKER_ROW_PRODUCTS"  # "0": cuBLAS and the separate fused kernels, norms unfolded (A/B)
ATTENTION_SPLITS_ENV = "WORKER_ATTENTION_SPLITS"  # pins the decode attention's split count (A/B comparisons)
PREFILL_TILES_ENV = "WORKER_PREFILL_TILES"  # "0": prompt rows in the decode kernel, one program per row (A/B)
# Decode attention's split count, pinned for all buckets, is at most this; a row takes fewer when its length gives
# each split under MIN_SPLIT_KEYS keys (triton_attention). One session's 3 (row, kv head) programs each walking
# all its keys cost the most at long lengths; short rows gain nothing from splitting and a 64-row step's 192
# programs fill the GPU. H100, SmolLM2-135M, 1-row / 64-row step: 1,000 keys 0.922 / 1.314 ms with 1 split,
# 0.800 / 1.406 with 2; 1,800 keys 1.175 / 1.730 and 0.936 / 1.864; 7,000 keys (1 row) 2.736 and 1.717; under
# 512 keys a step without the split kernel and its merge: 0.665 / 0.817 against 0.676 / 0.853 (why each decode
# bucket has a second graph, for steps whose longest row splits).
PINNED_SPLITS_MAX = 2
# Fixed slack in the workspace: cuBLAS workspaces (one per stream, the capture stream included),
# lazily loaded kernel modules of torch and Triton, and caching-allocator fragmentation.
FIXED_WORKSPACE_BYTES = 768 << 20
# cuBLAS workspace per (handle, stream), as CUBLAS_WORKSPACE_CONFIG spells it: 8 buffers of 16 KiB. Torch's default
# on Hopper is 32 MiB for every stream that runs a product, held for the life of the process (the capture stream's
# stays referenced by the graphs). Measured on the H100: the same decode-graph times and the same row-invariant
# buckets at 128 KiB as at 32 MiB, and 32 MiB less device memory with 64 sessions (ratio 1.057 -> 1.046).
CUBLAS_WORKSPACE_CONFIG = ":16:8"


def limit_cublas_workspace() -> str:
    """Set CUBLAS_WORKSPACE_CONFIG to CUBLAS_WORKSPACE_CONFIG unless the environment sets it; returns the value
    it now holds. Torch reads it once, at the process's first cuBLAS product: where one ran before (a caller's
    own products), the setting does not apply. The worker process calls this (Engine.load) before any."""
    return os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)


def fused_kernels_wanted() -> bool:
    """The fused layer stack (worker.kernels.layers) unless FUSED_ENV is "0"."""
    return os.environ.get(FUSED_ENV, "1") != "0"


def row_products_wanted() -> bool:
    """Decode steps in worker.kernels.matmul's kernels unless ROW_PRODUCTS_ENV or FUSED_ENV is "0". The engine folds
    the norms' weights into the products only then, so "0" gives back cuBLAS's numbers as well as its speed."""
    return os.environ.get(ROW_PRODUCTS_ENV, "1") != "0" and fused_kernels_wanted()


def attach_gpu_kernels(llama: Llama) -> None:
    """Route the model's decode-only batches through the Triton kernel (reads K/V from the slab), prompt chunks
    through the tiled one (worker.kernels.prefill) unless PREFILL_TILES_ENV is "0", and its layer stack and head
    through the fused kernels (worker.kernels.layers) unless FUSED_ENV is "0"."""
    from worker.kernels.attention import decode_attention
    from worker.kernels.layers import fused_head, fused_layers
    from worker.kernels.prefill import prefill_attention

    llama.decode_attention = decode_attention
    if os.environ.get(PREFILL_TILES_ENV, "1") != "0":
        llama.prefill_attention = prefill_attention
    if fused_kernels_wanted():
        llama.fused_layers = fused_layers
        llama.fused_head = fused_head


def workspace_bytes(llama: Llama) -> int:
    """Device memory to keep free beside the weights and the slab when sizing the session table.

    Generous on purpose: a session refused at create is cheap, an out-of-memory in a step is not.
    - activations of one eager step of up to GPU_STEP_TOKENS tokens (one layer live at a time, x2
      for the allocator holding the previous layer's blocks);
    - the attention of a prefill chunk: the model's masked SDPA with GQA takes the math path, which
      materialises fp32 scores, probabilities and the mask, (H, chunk, max_context) each;
    - logits: fp32 and model dtype for the largest eager decode, and the graphs' static outputs
      (one per bucket and the prefill graph's, kept alive in the shared pool);
    - FIXED_WORKSPACE_BYTES for cuBLAS workspaces, kernel modules and fragmentation.
    """
    from worker.engine.core import GPU_STEP_TOKENS

    c = llama.config
    item = torch.empty((), dtype=llama.dtype).element_size()
    context = llama.max_context
    chunk = min(GPU_STEP_TOKENS, context)
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    per_token = item * (4 * c.dim + qkv + c.n_heads * c.head_dim + 3 * c.ffn_dim)
    activations = 2 * GPU_STEP_TOKENS * per_token
    attention = 3 * c.n_heads * chunk * context * 4
    logits = 2 * BUCKETS[-1] * c.vocab_size * (4 + item) + (sum(BUCKETS) + PREFILL_LOGITS) * c.vocab_size * 4
    return activations + attention + logits + FIXED_WORKSPACE_BYTES


def _pinned_splits(value: str) -> int:
    """ATTENTION_SPLITS_ENV's value: an integer from 1 to the kernel's MAX_SPLITS."""
    from worker.kernels.attention import MAX_SPLITS

    try:
        splits = int(value)
    except ValueError:
        splits = 0
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{ATTENTION_SPLITS_ENV} must be an integer from 1 to {MAX_SPLITS}, got {value!r}")
    return splits


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


def make_gpu_executor(llama: Llama, table: SessionTable, cuda_graphs: bool = True) -> Executor:
    """GraphExecutor, or the eager executor (still with the Triton kernel) when graphs are off."""
    if os.environ.get(GRAPHS_ENV, "1") == "0":
        cuda_graphs = False
    if llama.decode_attention is None:
        attach_gpu_kernels(llama)
    if not cuda_graphs:
        log.info("cuda_graphs_disabled", env=GRAPHS_ENV)
    return GraphExecutor(llama, table, use_graphs=cuda_graphs)


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
    ) -> None:
        if model.decode_attention is None:
            raise ValueError("GraphExecutor needs the decode kernel: call attach_gpu_kernels(model) first")
        # torch's cuDNN attention backend builds, and keeps, an execution plan holding device memory outside
        # torch's allocator for every new (length, ...) shape. Prompt lengths rarely repeat, so a serving worker's
        # memory grew without end (~3 MiB per 40 prompts, worker/memory_churn.py); without it, it stays flat.
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
        # Decode steps' products in worker.kernels.matmul's fused kernels (with the fused layer stack on).
        # They need the norms' weights in the products (Llama(fold_norms=True), as Engine.load builds it).
        self.row_products: bool = model.fused_layers is not None and model.norms_folded and row_products_wanted()
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
            from worker.kernels.attention import MIN_SPLIT_KEYS, num_splits, sm_count

            c, sms = model.config, sm_count(device)
            # Pinned for every bucket (a row's attention must sum in the same order in any bucket): what the smallest
            # bucket wants, at most PINNED_SPLITS_MAX (see there).
            self.attention_splits = min(num_splits(self.buckets[0], c.n_kv_heads, model.max_context, sms),
                                        PINNED_SPLITS_MAX)
            pinned = os.environ.get(ATTENTION_SPLITS_ENV)
            if pinned:
                self.attention_splits = _pinned_splits(pinned)
                log.info("attention_splits_pinned", env=ATTENTION_SPLITS_ENV, splits=self.attention_splits)
            self.prefill_splits = num_splits(prefill_rows, c.n_kv_heads, model.max_context, sms)
            if self.attention_splits > 1 and model.max_context >= 2 * MIN_SPLIT_KEYS:
                self.long_rows_from = 2 * MIN_SPLIT_KEYS
        if use_graphs:
            start = time.perf_counter()
            # Largest activations first: the later graphs reuse its pool blocks (only outputs stay).
            for b in reversed(self.prefill_buckets):
                self._prefill_graphs[b], logits = self._capture(functools.partial(self._prefill_step, b))
                if self._prefill_out is None:
                    self._prefill_out = logits  # the smaller prefill graphs copy their logits into it
            for b in reversed(self.buckets):
                self._graphs[b] = self._capture(functools.partial(self._step, b))
                if self.long_rows_from is not None:  # writes its logits into the short graph's output
                    self._long_graphs[b], _ = self._capture(functools.partial(self._step, b, True))
            torch.cuda.synchronize(device)
            log.info("cuda_graphs_captured", buckets=self.buckets, prefill_buckets=self.prefill_buckets,
                     seconds=round(time.perf_counter() - start, 2))
        if device.type == "cuda":
            self._keep_row_invariant_buckets()

    @property
    def max_decode_rows(self) -> int:
        """The most decode rows one replay serves."""
        return self.buckets[-1]

    def execute(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        logits_at: list[int],
        source: tuple[torch.Tensor, list[int]] | None = None,
        copy_logits: bool = True,
    ) -> torch.Tensor:
        """Logits (len(logits_at), vocab) fp32 (see Executor.execute). `source` (ids, picks): the first
        len(picks) rows take their token from ids[picks[i]], read on the device; with it, a step's decode rows
        fit one replay (at most max_decode_rows)."""
        n = len(positions)
        if n <= self.buckets[-1] and len(set(slots)) == n and logits_at == list(range(n)):
            # The common case: every row a different session's one token (prompt chunks share a slot), one replay.
            return self._decode(tokens, positions, slots, source, copy_logits)
        decode, prefill = split_step(tokens, positions, slots)
        if source is not None and (len(decode) > self.buckets[-1] or decode[: len(source[1])] != list(range(len(source[1])))):
            raise ValueError("token ids from the device serve the first rows of a step's one decode replay")
        wanted = set(logits_at)
        rows: dict[int, torch.Tensor] = {}
        biggest = self.buckets[-1]
        for i in range(0, len(decode), biggest):
            part = decode[i : i + biggest]
            logits = self._decode([tokens[r] for r in part], [positions[r] for r in part], [slots[r] for r in part],
                                  source)
            rows.update((r, logits[j]) for j, r in enumerate(part) if r in wanted)
        missing = wanted.difference(decode, (run.start + run.n - 1 for run in prefill))
        if missing:
            raise ValueError(f"logits of prefill rows {sorted(missing)} other than a chunk's last are not kept")
        groups = self._prefill_groups(prefill)
        for i, group in enumerate(groups):
            keys, logits = self._prefill(group, tokens, positions, wanted)
            if i + 1 < len(groups):
                logits = logits.clone()  # the next prefill replay rewrites the graphs' output
            rows.update(zip(keys, logits, strict=True))
        return torch.stack([rows[r] for r in logits_at]) if logits_at else torch.empty(
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

    def _prefill(
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
            logits = self._prefill_step(bucket)
        self.table.mark_used(sorted({r.slot for r in runs}))
        return keys, logits[: len(keys)]

    def _decode(
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
            logits = self._step(bucket, long)
        self.table.mark_used(slots)  # one row per session: distinct
        return logits[:n].clone() if copy_logits else logits[:n]

    def _keep_row_invariant_buckets(self) -> None:
        """Drop every bucket whose rows differ in any bit from the same rows run in the largest bucket,
        decode and prefill buckets alike.

        Real rows: temporary slots with random K/V in their first positions; decode rows are random
        tokens at random positions there, prefill chunks random tokens from random offsets there. So the
        products, the attention and the head all see ordinary numbers. A library that picks another
        reduction order for another row count shows up in the logits; the bucket's batches then run in
        the next larger one (slower, never different).
        """
        if len(self.buckets) == 1 and len(self.prefill_buckets) == 1 and self.long_rows_from is None:
            return
        start = time.perf_counter()
        gen = torch.Generator(device=self.model.device).manual_seed(0)
        slots: list[int] = []
        dropped: list[int] = []
        dropped_prefill: list[int] = []
        try:
            wanted = max(self.buckets[-2] if len(self.buckets) > 1 else 0, INVARIANCE_CHECK_CHUNKS)
            for _ in range(min(wanted, self.table.capacity)):
                slots.append(self.table.create())
            span = min(INVARIANCE_CHECK_POSITIONS, self.model.max_context - 1)
            filled = min(span + (self.long_rows_from or 0), self.model.max_context - 1)  # long rows reach past span
            for buf in self.table.spec.buffers:
                view = self.state[buf.name]
                for slot in slots:
                    part = view[slot] if buf.seq_axis is None else view[slot].narrow(buf.seq_axis, 0, filled)
                    part.copy_(torch.randn(part.shape, generator=gen, device=part.device, dtype=torch.float32))
            if self.long_rows_from is not None and not self._split_graphs_agree(slots, gen):
                log.warning("split_attention_differs", detail="short rows differ between the two attentions: every "
                            "step takes the split one", long_rows_from=self.long_rows_from)
                self.long_rows_from = 1  # every row: every step replays the split graphs
            short = self.long_rows_from != 1  # the graphs without split attention serve steps
            split = self.long_rows_from is not None  # each bucket's split graph too, rows long and short
            dropped = [b for b in self.buckets[:-1] if short and not self._decode_invariant(b, slots, span, gen)
                       or split and not self._decode_invariant(b, slots, filled, gen, long=True)]
            dropped_prefill = [b for b in self.prefill_buckets[:-1] if not self._prefill_invariant(b, slots, span, gen)]
        except StateError as e:  # no room for the check's slots: keep only the largest buckets
            log.warning("buckets_unchecked", error=str(e), kept=[self.buckets[-1]], prefill_kept=[self.prefill_rows])
            dropped, dropped_prefill = self.buckets[:-1], self.prefill_buckets[:-1]
            if self.long_rows_from is not None:  # the two attentions' agreement unchecked: the split one only
                self.long_rows_from = 1
        finally:
            for slot in slots:
                self.table.free(slot)
            self.table.trim()  # the check's slots are not kept mapped for sessions
        for b in dropped:
            self.buckets.remove(b)
            self._graphs.pop(b, None)
            self._long_graphs.pop(b, None)
        for b in dropped_prefill:
            self.prefill_buckets.remove(b)
            self._prefill_graphs.pop(b, None)
        self.replays = self.prefill_replays = 0
        torch.cuda.empty_cache()  # the check's temporaries: nothing of it stays on the device
        if dropped or dropped_prefill:
            log.warning("buckets_not_row_invariant", dropped=dropped, kept=self.buckets,
                        prefill_dropped=dropped_prefill, prefill_kept=self.prefill_buckets,
                        detail="their matrix products sum in another order than the largest bucket's")
        log.info("buckets_checked", buckets=self.buckets, prefill_buckets=self.prefill_buckets,
                 seconds=round(time.perf_counter() - start, 3))

    def _decode_invariant(self, b: int, slots: list[int], span: int, gen: torch.Generator, long: bool = False) -> bool:
        """b decode rows (b <= len(slots)) at positions below `span` give the same logits in bucket b as in the
        largest bucket (long: in the split attention's graphs)."""
        vocab, device = self.model.config.vocab_size, self.model.device
        tokens = torch.randint(0, vocab, (b,), generator=gen, device=device).tolist()
        positions = torch.randint(1, span, (b,), generator=gen, device=device).tolist()
        if long and self.long_rows_from is not None and span > self.long_rows_from:  # a row that splits, at least
            positions[0] = int(torch.randint(self.long_rows_from - 1, span, (), generator=gen, device=device))
        wide = self._decode(tokens, positions, slots[:b], bucket=self.buckets[-1], long=long)
        own = self._decode(tokens, positions, slots[:b], bucket=b, long=long)
        return torch.equal(wide, own)

    def _split_graphs_agree(self, slots: list[int], gen: torch.Generator) -> bool:
        """Rows shorter than long_rows_from give the same logits in the split attention's graph as in the other
        (what lets a step's longest row pick the graph without moving the others' numbers)."""
        assert self.long_rows_from is not None
        vocab, device = self.model.config.vocab_size, self.model.device
        rows = min(len(slots), self.buckets[-1])
        tokens = torch.randint(0, vocab, (rows,), generator=gen, device=device).tolist()
        positions = torch.randint(1, self.long_rows_from - 1, (rows,), generator=gen, device=device).tolist()
        split = self._decode(tokens, positions, slots[:rows], bucket=self.buckets[-1], long=True)
        return torch.equal(split, self._decode(tokens, positions, slots[:rows], bucket=self.buckets[-1], long=False))

    def _prefill_invariant(self, b: int, slots: list[int], span: int, gen: torch.Generator) -> bool:
        """Prompt chunks filling most of b rows, one per slot from a random offset, give the same logits at
        their ends in prefill bucket b as in the largest one."""
        vocab, device = self.model.config.vocab_size, self.model.device
        slots = slots[: min(INVARIANCE_CHECK_CHUNKS, self.prefill_logits)]  # one replay's chunks at most
        offsets = torch.randint(0, span, (len(slots),), generator=gen, device=device).tolist()
        lengths = [max(2, min(b // len(slots), self.model.max_context - o)) for o in offsets]
        runs: list[Run] = []
        positions: list[int] = []
        for slot, offset, n in zip(slots, offsets, lengths, strict=True):
            runs.append(Run(slot=slot, start=len(positions), n=n, pos=offset))
            positions += range(offset, offset + n)
        tokens = torch.randint(0, vocab, (len(positions),), generator=gen, device=device).tolist()
        ends = {run.start + run.n - 1 for run in runs}
        _, wide = self._prefill(runs, tokens, positions, ends, bucket=self.prefill_rows)
        wide = wide.clone()
        _, own = self._prefill(runs, tokens, positions, ends, bucket=b)
        return torch.equal(wide, own)

    # -- steps ----------------------------------------------------------------------------------

    def _step(self, b: int, long: bool = False) -> torch.Tensor:
        """The decode forward over the first b static rows: logits (b, vocab) fp32.

        long False with long_rows_from set: attention in one program per (row, KV head), for steps whose rows are
        all shorter than long_rows_from (no merge kernel). long True: keys split attention_splits ways, each row as
        its length wants (triton_attention: rows shorter than long_rows_from in one split, the same bits), the
        logits written into the short graph's output once that exists."""
        tokens, positions, slots, lengths = self._decode_in.device[:, :b]
        splits = self.attention_splits if long or self.long_rows_from is None else 1
        batch = Batch(runs=[], decode_only=True, lengths=lengths.to(torch.int32),
                      attention_splits=splits, row_products=self.row_products)
        logits = self.model.forward(tokens, positions, slots, self.state, batch)
        short = self._graphs.get(b)
        return _into(short[1] if long and short is not None else None, logits)

    def _prefill_step(self, b: int) -> torch.Tensor:
        """The prefill forward over the first b static prefill rows: logits (prefill_logits, vocab) fp32,
        written into the largest prefill graph's output once that exists (graphs).

        Every row is a query of its own session at its position, its attention from the slab by slot and length:
        the tiled prompt kernel's (or with PREFILL_TILES_ENV "0" the decode kernel's, `decode_only`); logits only at
        the chunk ends."""
        tokens, positions, slots, lengths, ends, _, _ = self._prefill_in.device[:, :b]
        tiles = self._prefill_in.device[5:, : max_tiles(b, self.prefill_logits)]
        batch = Batch(runs=[], decode_only=True, lengths=lengths.to(torch.int32), attention_splits=self.prefill_splits,
                      tiles=tiles if self.model.prefill_attention is not None else None)
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
