from __future__ import annotations

import pytest

import cuda_state
from worker.engine import Engine
from worker.errors import CapacityExhausted


def test_capacity_exhausted_is_the_cuda_state_class() -> None:
    assert CapacityExhausted is cuda_state.CapacityExhausted
    assert CapacityExhausted.code == "capacity_exhausted"


def test_max_sessions_then_refusal_then_close_frees(engine: Engine) -> None:
    assert engine.capacity == 8
    sids = [engine.create_session() for _ in range(8)]
    assert engine.free_slots == 0
    with pytest.raises(CapacityExhausted, match="all 8 session slots are in use"):
        engine.create_session()
    with pytest.raises(CapacityExhausted):
        engine.fork(sids[0])
    engine.close(sids[3])
    assert engine.free_slots == 1
    again = engine.create_session()
    engine.append(again, text="still works")
    assert engine.generate(again, max_tokens=2, ignore_eos=True).finish_reason == "length"


def test_bytes_per_session_is_the_spec_size(engine: Engine) -> None:
    # K and V: 30 layers x 3 kv heads x 2048 positions x 64 dims x 4 bytes (fp32) each.
    expected = 2 * 30 * 3 * 2048 * 64 * 4
    assert engine.bytes_per_session == expected == 94_371_840
    assert engine.model.state_spec().bytes_per_session == expected
    assert engine.table.slot_bytes == expected  # already a multiple of the host page size
