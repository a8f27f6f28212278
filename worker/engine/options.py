"""The engine's switches, read once at the process edge into one typed value.

Each has an environment variable for A/B runs (docs/tuning.md says what each buys). `EngineOptions.from_env()`
reads them; the worker's CLI and Engine.load (when given no options) call it, nothing deeper does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

GRAPHS_ENV = "WORKER_CUDA_GRAPHS"  # "0": eager GPU steps (the same kernels and shapes, no graphs)
FUSED_ENV = "WORKER_FUSED_KERNELS"  # "0": the plain torch layer loop on the GPU
ROW_PRODUCTS_ENV = "WORKER_ROW_PRODUCTS"  # "0": decode products in cuBLAS, the norms unfolded
ATTENTION_SPLITS_ENV = "WORKER_ATTENTION_SPLITS"  # pins the decode attention's split count (1..MAX_SPLITS)
PREFILL_TILES_ENV = "WORKER_PREFILL_TILES"  # "0": prompt rows in the decode kernel, one program per row
PDL_ENV = "WORKER_PDL"  # "0": Triton kernels launch without programmatic dependent launch


@dataclass(frozen=True)
class EngineOptions:
    """What the GPU path runs. The defaults are the fast, batch-invariant path; the CPU path uses none of them."""

    cuda_graphs: bool = True  # steps replay captured CUDA graphs
    fused_kernels: bool = True  # the layer stack in fused Triton kernels (worker.kernels.layers)
    row_products: bool = True  # decode products in row-invariant Triton kernels, norms folded (needs fused_kernels)
    prefill_tiles: bool = True  # prompt chunks' attention in tiles (worker.kernels.prefill)
    pdl: bool = True  # programmatic dependent launch on Hopper and later (worker.kernels.pdl)
    attention_splits: int | None = None  # None: chosen from the shapes; else pinned for every bucket

    @property
    def folds_norms(self) -> bool:
        """The norms' weights ride in the products (worker.model.llama.Layer): only for row products."""
        return self.row_products and self.fused_kernels

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineOptions:
        """The switches from WORKER_* variables ("0" turns one off). Raises ValueError naming a bad value."""
        env = os.environ if env is None else env

        def on(name: str) -> bool:
            return env.get(name, "1") != "0"

        splits = env.get(ATTENTION_SPLITS_ENV) or None
        return cls(cuda_graphs=on(GRAPHS_ENV), fused_kernels=on(FUSED_ENV), row_products=on(ROW_PRODUCTS_ENV),
                   prefill_tiles=on(PREFILL_TILES_ENV), pdl=on(PDL_ENV),
                   attention_splits=None if splits is None else pinned_splits(splits))


def pinned_splits(value: str) -> int:
    """ATTENTION_SPLITS_ENV's value: an integer from 1 to the attention kernel's MAX_SPLITS."""
    from worker.kernels.attention import MAX_SPLITS

    try:
        splits = int(value)
    except ValueError:
        splits = 0
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{ATTENTION_SPLITS_ENV} must be an integer from 1 to {MAX_SPLITS}, got {value!r}")
    return splits
