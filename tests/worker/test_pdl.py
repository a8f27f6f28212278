"""Programmatic dependent launch: on for CUDA tensors of Hopper and later, off elsewhere and when asked."""

from __future__ import annotations

import pytest
import torch

from worker.kernels import pdl


def test_pdl_is_off_for_cpu_tensors_and_launches_then_pass_only_the_flag() -> None:
    t = torch.zeros(1)
    assert not pdl.enabled(t)
    assert pdl.launch_options(t) == {"PDL": False}  # no launch_pdl keyword: the interpreter takes none


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pdl_follows_the_device_generation_and_the_switch() -> None:
    t = torch.zeros(1, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    pdl.configure(True)
    try:
        assert pdl.enabled(t) is (hopper and pdl.HAVE_GDC)
        if pdl.enabled(t):
            assert pdl.launch_options(t) == {"PDL": True, "launch_pdl": True}
        pdl.configure(False)
        assert not pdl.enabled(t)
    finally:
        pdl.configure(True)
