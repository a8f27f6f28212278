"""The hybrid model's GPU kernels (worker.kernels.deltanet, worker.kernels.norms) in Triton's interpreter on the CPU,
against the torch code the CPU model runs (in a subprocess: TRITON_INTERPRET is read at import): the kernels alone,
and the whole tiny model's GPU forward (steps as the GPU executor shapes them) against its torch forward. The GPU's
own tests (tests/worker/gpu/test_hybrid.py) run the same model in bf16 through the CUDA graphs."""

from __future__ import annotations

import pytest

from tests.worker.interpreted import run_interpreted

# Warnings are errors in this project; a deprecation inside Triton's own code is not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton")


def test_the_deltanet_kernels_match_the_torch_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted("deltanet_kernels", timeout_s=900)


def test_the_hybrid_models_gpu_forward_matches_its_torch_forward_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    run_interpreted("hybrid_forward", timeout_s=900)
