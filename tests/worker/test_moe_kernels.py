"""The mixture-of-experts kernels (worker.kernels.moe) in Triton's interpreter on the CPU, against the torch code the CPU
model runs (in a subprocess: TRITON_INTERPRET is read at import): the routing, the grouping by expert, the block and
its batch invariance; and the whole tiny Qwen3.5-MoE's GPU forward against its torch forward. The GPU's own tests
(tests/worker/gpu/test_moe.py) run the model in bf16 through the CUDA graphs."""

from __future__ import annotations

import pytest

from tests.worker.interpreted import run_interpreted

# Warnings are errors in this project; a deprecation inside Triton's own code is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


def test_the_moe_kernels_match_the_torch_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted("moe_kernels", timeout_s=600)


@pytest.mark.slow  # about a minute on two shared cores
def test_the_moe_models_gpu_forward_matches_its_torch_forward_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted("moe_forward", timeout_s=900)
