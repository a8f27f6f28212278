"""The tiny Qwen3.5-MoE (worker.model.qwen3_5_moe) through its GPU forward (the routed experts in
worker.kernels.moe's kernels, the router and the shared expert in the row-invariant products for decode steps, with the
hybrid layers' kernels) against its torch forward, in fp32: the steps of tests/worker/interpreted/hybrid_forward.py.
Run by tests/worker/test_moe_kernels.py."""

from __future__ import annotations

from tests.worker.interpreted.hybrid_forward import main

if __name__ == "__main__":
    main("tiny-qwen3.5-moe")
