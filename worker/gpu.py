"""The GPU side of the engine: the Triton decode kernel, workspace sizing and CUDA-graph decode.

A decode step (every row one token of a different session) is captured once per batch-size bucket
and replayed for any set of sessions: state lives at fixed addresses in the slab and the model
indexes it by slot, so only the small static input tensor changes between replays. Padding rows of
a bucket point at the table's spare slot (always mapped) at position 0 with length 1, so a padded
row reads and writes only memory nobody else uses.

Batch invariance: a row's numbers must not depend on what else is in the step (the same seed and
inputs give the same tokens whatever else runs). Matrix kernels pick their reduction order by the
shape, so every decode row runs in a bucket of at least MIN_BUCKET rows (one bucket, one kernel,
for up to MIN_BUCKET sessions; on a model this size a 64-row step costs what a 1-row step does),
and the prefill chunks of a step run packed in one forward padded to a fixed PREFILL_ROWS rows, with
attention per chunk. A step that mixes decode rows and prefill chunks is split that way: decode rows
from the graph, the chunks in one eager forward.
"""

from __future__ import annotations

import bisect
import os
import time

import numpy as np
import structlog
import torch

from cuda_state import SessionTable

from .executor import EagerExecutor, Executor
from .model import Batch, Llama, Run, runs_of

log = structlog.get_logger(__name__)

MIN_BUCKET = 64  # decode batches of up to this many rows share one shape: batch-invariant numbers
BUCKETS = (MIN_BUCKET, 128, 256)  # decode batch sizes captured as graphs; larger batches are cut
WARMUP_RUNS = 2  # eager runs on the capture stream before capturing (compiles Triton, inits cuBLAS)
PREFILL_ROWS = 2048  # rows of every prefill forward (= the engine's GPU step budget for prompt tokens)
GRAPHS_ENV = "WORKER_CUDA_GRAPHS"  # "0" disables graphs whatever the caller asked for
FUSED_ENV = "WORKER_FUSED_KERNELS"  # "0" keeps the plain torch layer loop on the GPU (A/B comparisons)
# Fixed slack in the workspace: cuBLAS workspaces (one per stream, the capture stream included),
# lazily loaded kernel modules of torch and Triton, and caching-allocator fragmentation.
FIXED_WORKSPACE_BYTES = 768 << 20


def attach_gpu_kernels(llama: Llama) -> None:
    """Route the model's decode-only batches through the Triton kernel (reads K/V from the slab), and
    its layer stack through the fused kernels (worker.fused_forward) unless FUSED_ENV is "0"."""
    from .fused_forward import fused_layers
    from .triton_attention import decode_attention

    llama.decode_attention = decode_attention
    if os.environ.get(FUSED_ENV, "1") != "0":
        llama.fused_layers = fused_layers


def workspace_bytes(llama: Llama) -> int:
    """Device memory to keep free beside the weights and the slab when sizing the session table.

    Generous on purpose: a session refused at create is cheap, an out-of-memory in a step is not.
    - activations of one eager step of up to GPU_STEP_TOKENS tokens (one layer live at a time, x2
      for the allocator holding the previous layer's blocks);
    - the attention of a prefill chunk: the model's masked SDPA with GQA takes the math path, which
      materialises fp32 scores, probabilities and the mask, (H, chunk, max_context) each;
    - logits: fp32 and model dtype for the largest eager decode, and the graphs' static outputs
      (one per bucket, kept alive in the shared pool);
    - FIXED_WORKSPACE_BYTES for cuBLAS workspaces, kernel modules and fragmentation.
    """
    from .engine import GPU_STEP_TOKENS

    c = llama.config
    item = torch.empty((), dtype=llama.dtype).element_size()
    context = llama.max_context
    chunk = min(GPU_STEP_TOKENS, context)
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    per_token = item * (4 * c.dim + qkv + c.n_heads * c.head_dim + 3 * c.ffn_dim)
    activations = 2 * GPU_STEP_TOKENS * per_token
    attention = 3 * c.n_heads * chunk * context * 4
    logits = 2 * BUCKETS[-1] * c.vocab_size * (4 + item) + sum(BUCKETS) * c.vocab_size * 4
    return activations + attention + logits + FIXED_WORKSPACE_BYTES


def buckets_for(capacity: int) -> list[int]:
    """BUCKETS up to the table's capacity, plus the capacity itself when it falls between two."""
    if capacity >= BUCKETS[-1]:
        return list(BUCKETS)
    return [b for b in BUCKETS if b < capacity] + [capacity]


def pick_bucket(buckets: list[int], rows: int) -> int:
    """The smallest bucket (sorted ascending) that holds `rows` decode rows (1 <= rows <= buckets[-1])."""
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


class GraphExecutor:
    """Decode rows replayed from CUDA graphs, one per bucket; prefill chunks eager, one forward each.

    With use_graphs=False the same padded decode steps run eagerly (the same kernels and shapes,
    so the same numbers): the switch changes launch overhead only.
    """

    def __init__(
        self,
        model: Llama,
        table: SessionTable,
        buckets: list[int] | None = None,
        use_graphs: bool = True,
        prefill_rows: int = PREFILL_ROWS,
    ) -> None:
        if model.decode_attention is None:
            raise ValueError("GraphExecutor needs the decode kernel: call attach_gpu_kernels(model) first")
        # torch's cuDNN attention backend builds, and keeps, an execution plan holding device memory outside
        # torch's allocator for every new (length, ...) shape. Prompt lengths rarely repeat, so a serving worker's
        # memory grew without end (~3 MiB per 40 prompts, worker/memory_churn.py); without it, it stays flat.
        torch.backends.cuda.enable_cudnn_sdp(False)
        self.model: Llama = model
        self.table: SessionTable = table
        self.eager: EagerExecutor = EagerExecutor(model, table)
        self.state: dict[str, torch.Tensor] = table.views()
        self.buckets: list[int] = sorted(buckets or buckets_for(table.capacity))
        self.replays: int = 0  # decode steps served by a graph (for tests and metrics)
        rows = self.buckets[-1]
        device = model.device
        # Rows: token ids, positions, slots, lengths. Padding columns: token 0 at position 0 of the spare.
        self._padding: np.ndarray = np.array([[0], [0], [table.spare_slot], [1]], dtype=np.int64)
        self._host: torch.Tensor = torch.zeros((4, rows), dtype=torch.long).pin_memory()
        self._host_np: np.ndarray = self._host.numpy()
        self._host_np[:] = self._padding
        self._inputs: torch.Tensor = self._host.to(device)  # (4, rows) int64, static: the graphs read it
        self._copied: torch.cuda.Event = torch.cuda.Event()  # the last host->device input copy has read self._host
        self._copied.record()
        self._stream: torch.cuda.Stream = torch.cuda.Stream(device)
        self.use_graphs: bool = use_graphs
        # Every prefill forward has this many rows (chunks packed, the rest padding): one shape.
        self.prefill_rows: int = prefill_rows
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if use_graphs:
            start = time.perf_counter()
            for b in reversed(self.buckets):  # largest first: smaller graphs reuse its pool blocks
                self._graphs[b] = self._capture(b)
            torch.cuda.synchronize(device)
            log.info("cuda_graphs_captured", buckets=self.buckets, seconds=round(time.perf_counter() - start, 2))

    def execute(self, tokens: list[int], positions: list[int], slots: list[int], logits_at: list[int]) -> torch.Tensor:
        decode, prefill = split_step(tokens, positions, slots)
        if not prefill and logits_at == list(range(len(tokens))) and len(tokens) <= self.buckets[-1]:
            return self._decode(tokens, positions, slots)  # the common case: one replay, no reordering
        wanted = set(logits_at)
        rows: dict[int, torch.Tensor] = {}
        biggest = self.buckets[-1]
        for i in range(0, len(decode), biggest):
            part = decode[i : i + biggest]
            logits = self._decode([tokens[r] for r in part], [positions[r] for r in part], [slots[r] for r in part])
            rows.update((r, logits[j]) for j, r in enumerate(part) if r in wanted)
        missing = wanted.intersection(r for run in prefill for r in range(run.start, run.start + run.n - 1))
        if missing:
            raise ValueError(f"logits of prefill rows {sorted(missing)} other than a chunk's last are not kept")
        for group in self._prefill_groups(prefill):
            rows.update(self._prefill(group, tokens, positions, slots, wanted))
        return torch.stack([rows[r] for r in logits_at]) if logits_at else torch.empty(
            (0, self.model.config.vocab_size), dtype=torch.float32, device=self.model.device
        )

    def _prefill_groups(self, runs: list[Run]) -> list[list[Run]]:
        """Prefill runs packed in order into forwards of at most `prefill_rows` tokens."""
        groups: list[list[Run]] = []
        size = self.prefill_rows + 1
        for run in runs:
            if size + run.n > self.prefill_rows:
                groups.append([])
                size = 0
            groups[-1].append(run)
            size += run.n
        return groups

    def _prefill(
        self, runs: list[Run], tokens: list[int], positions: list[int], slots: list[int], wanted: set[int]
    ) -> dict[int, torch.Tensor]:
        """One forward over several sessions' prefill chunks, padded to `prefill_rows` rows.

        The fixed shape makes every matrix product the same kernel whatever the chunks are, and
        attention runs per chunk, so a chunk's numbers do not depend on its neighbours. Padding
        rows write K/V at position 0 of the spare slot and take part in no attention.
        """
        rows = max(self.prefill_rows, sum(r.n for r in runs))
        spare = self.table.spare_slot
        t, p, s = [0] * rows, [0] * rows, [spare] * rows
        packed: list[Run] = []
        at: list[int] = []  # packed row of each wanted chunk end
        keys: list[int] = []  # the caller's row for it
        cursor = 0
        for run in runs:
            end = run.start + run.n
            t[cursor : cursor + run.n] = tokens[run.start : end]
            p[cursor : cursor + run.n] = positions[run.start : end]
            s[cursor : cursor + run.n] = slots[run.start : end]
            packed.append(Run(run.slot, cursor, run.n, run.pos))
            if end - 1 in wanted:
                at.append(cursor + run.n - 1)
                keys.append(end - 1)
            cursor += run.n
        dev = self.model.device
        batch = Batch(packed, decode_only=False, padded=cursor < rows)
        logits = self.model.forward(
            torch.tensor(t, dtype=torch.long, device=dev),
            torch.tensor(p, dtype=torch.long, device=dev),
            torch.tensor(s, dtype=torch.long, device=dev),
            self.state,
            batch,
            torch.tensor(at, dtype=torch.long, device=dev),
        )
        self.table.mark_used(sorted({r.slot for r in runs}))
        return {key: logits[i] for i, key in enumerate(keys)}

    def _decode(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """One padded decode step over distinct sessions' single tokens: logits (n, vocab), a copy."""
        n = len(tokens)
        bucket = pick_bucket(self.buckets, n)
        self._load_inputs(tokens, positions, slots)
        if self.use_graphs:
            graph, logits = self._graphs[bucket]
            graph.replay()
            self.replays += 1
        else:
            logits = self._step(bucket)
        self.table.mark_used(sorted(set(slots)))
        return logits[:n].clone()

    # -- steps ----------------------------------------------------------------------------------

    def _step(self, b: int) -> torch.Tensor:
        """The decode forward over the first b static rows: logits (b, vocab) fp32."""
        tokens, positions, slots, lengths = self._inputs[:, :b]
        batch = Batch(runs=[], decode_only=True, lengths=lengths.to(torch.int32))
        return self.model.forward(tokens, positions, slots, self.state, batch)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on the capture stream, then capture. Static inputs hold padding: only the spare is touched."""
        current = torch.cuda.current_stream(self.model.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for _ in range(WARMUP_RUNS):
                self._step(b)
        current.wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            logits = self._step(b)
        return graph, logits

    def _load_inputs(self, tokens: list[int], positions: list[int], slots: list[int]) -> None:
        n = len(tokens)
        self._copied.synchronize()  # the previous step's copy has finished reading the pinned buffer
        host = self._host_np
        host[0, :n] = tokens
        host[1, :n] = positions
        host[2, :n] = slots
        host[3, :n] = host[1, :n] + 1
        host[:, n:] = self._padding
        self._inputs.copy_(self._host, non_blocking=True)
        self._copied.record()
