"""Building an engine's parts in named steps, llama2.c's build_* style: device, weights, model, table, executor.

Engine.load chains them; Engine.close frees the same parts in reverse order.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import structlog
import torch

from cuda_state import SessionTable
from cuda_state.select import Choice, open_backend, select_backend
from worker.engine.budget import AHEAD_TOKENS, CPU_STEP_TOKENS, GPU_STEP_TOKENS
from worker.engine.executor import EagerExecutor, Executor
from worker.engine.options import EngineOptions
from worker.model.batch import NO_KERNELS
from worker.model.families import model_class
from worker.model.llama import Llama
from worker.model.loader import LoadedModel, load_model
from worker.model.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


class Parts(NamedTuple):
    """What an Engine is made of (its constructor's arguments)."""

    model: Llama
    tokenizer: Tokenizer
    table: SessionTable
    executor: Executor
    model_name: str
    step_tokens: int
    weights_id: str = ""  # LoadedModel.weights_id: which weights, beyond the name


def build_parts(model: str | None, device: str, max_sessions: int, max_context: int, step_tokens: int | None,
                options: EngineOptions, state_pages: int | None = None, host_page_bytes: int | None = None) -> Parts:
    """Load weights once, build the model on the chosen device, open the session table and make the executor."""
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    if step_tokens is not None and step_tokens < 1:  # no prompt token would ever fit a step: generations never end
        raise ValueError(f"step_tokens must be >= 1 (None: the device's default), got {step_tokens}")
    choice = select_device(device)
    on_gpu = choice.device.type == "cuda"
    if on_gpu:
        configure_gpu(options)
    loaded = load_model(model)
    llama = build_model(loaded, choice.device, max_context, options)
    table = open_table(choice, llama, max_sessions, state_pages, host_page_bytes)
    executor = make_executor(llama, table, options)
    return Parts(llama, loaded.tokenizer, table, executor, loaded.config.name,
                 step_tokens or (GPU_STEP_TOKENS if on_gpu else CPU_STEP_TOKENS), loaded.weights_id)


def select_device(device: str) -> Choice:
    choice = select_backend(device)
    log.info("device_selected", backend=choice.kind, device=str(choice.device), reason=choice.reason)
    return choice


def configure_gpu(options: EngineOptions) -> None:
    """Process-wide settings read once, before the first kernel or product runs."""
    from worker.engine.workspace import limit_cublas_workspace
    from worker.kernels import pdl

    log.info("cublas_workspace", config=limit_cublas_workspace(), applies="unless cuBLAS ran earlier in the process")
    pdl.configure(options.pdl)


def build_model(loaded: LoadedModel, device: torch.device, max_context: int, options: EngineOptions) -> Llama:
    """The model of the config's family on `device`: bf16 with the GPU kernels on a GPU, fp32 in plain torch on the
    CPU. On the GPU the
    norms' weights ride in the products when decode steps use row products (worker.model.llama.Layer)."""
    on_gpu = device.type == "cuda"
    kernels = NO_KERNELS
    if on_gpu:
        from worker.kernels import gpu_kernels

        kernels = gpu_kernels(prefill_tiles=options.prefill_tiles, fused=options.fused_kernels)
    context = min(max_context, loaded.config.context_length)
    start = time.perf_counter()
    llama = model_class(loaded.config)(loaded.config, loaded.read(device), device,
                                       torch.bfloat16 if on_gpu else torch.float32, context,
                                       fold_norms=on_gpu and options.folds_norms, kernels=kernels)
    if on_gpu:
        torch.cuda.synchronize(device)
    log.info("weights_loaded", model=loaded.config.name, gib=round(llama.weight_bytes() / 2**30, 2),
             seconds=round(time.perf_counter() - start, 2))
    return llama


def open_table(choice: Choice, llama: Llama, max_sessions: int, state_pages: int | None = None,
               host_page_bytes: int | None = None) -> SessionTable:
    """The session table: `max_sessions` slots of max_context each in virtual memory, backed page by page as sessions
    grow, the pages bounded by `state_pages` and, on the GPU, by free memory after the weights and the workspace.
    On the GPU closed sessions' slots keep their first page for the next ones (no driver allocation per session);
    the worker releases those unused for a while (Engine.release_idle_slots)."""
    if choice.device.type != "cuda":
        return SessionTable(open_backend(choice, llama.state_spec(), max_sessions, page_budget=state_pages,
                                         host_page_bytes=host_page_bytes), ahead_tokens=AHEAD_TOKENS)
    from worker.engine.workspace import workspace_bytes

    backend = open_backend(choice, llama.state_spec(), max_sessions, workspace_bytes(llama), page_budget=state_pages)
    return SessionTable(backend, keep_mapped=backend.num_slots - 1, ahead_tokens=AHEAD_TOKENS)


def make_executor(llama: Llama, table: SessionTable, options: EngineOptions) -> Executor:
    """The GPU's graph executor (eager replays of the same padded steps with cuda_graphs off), the CPU's eager one."""
    if llama.device.type != "cuda":
        return EagerExecutor(llama, table)
    from worker.engine.graphs import GraphExecutor

    if not options.cuda_graphs:
        log.info("cuda_graphs_disabled")
    return GraphExecutor(llama, table, use_graphs=options.cuda_graphs, row_products=options.row_products,
                         attention_splits=options.attention_splits)
