from __future__ import annotations

import pytest
import torch

from cuda_state import BufferSpec, CapacityExhausted, HostBackend, SessionTable, SlotError, StateSpec
from cuda_state.backend import slab_views

SPEC = StateSpec(
    (
        BufferSpec("k", (2, 3, 16, 4), torch.float32, seq_axis=2),
        BufferSpec("v", (2, 3, 16, 4), torch.float32, seq_axis=2),
        BufferSpec("conv", (5,), torch.bfloat16),  # fixed-size state: copied whole
    )
)


def test_spec_sizes_and_offsets() -> None:
    assert SPEC.buffer("k").nbytes == 2 * 3 * 16 * 4 * 4 == 1536
    assert SPEC.offsets == {"k": 0, "v": 1536, "conv": 3072}
    assert SPEC.bytes_per_session == 3072 + 10
    assert SPEC.slot_bytes(4096) == 4096
    assert SPEC.slot_bytes(2 << 20) == 2 << 20
    assert SPEC.fixed_bytes == 10 and not SPEC.positional
    assert StateSpec(SPEC.buffers[:2]).positional and StateSpec(SPEC.buffers[:2]).fixed_bytes == 0


def test_prefix_copy_geometry() -> None:
    k = SPEC.buffer("k")
    # rows = layers * kv_heads, width = used * head_dim * 4 bytes, pitch = max_context * head_dim * 4
    assert k.prefix_copy(5) == (6, 5 * 16, 16 * 16)
    assert k.prefix_copy(99) == (6, 16 * 16, 16 * 16)
    assert SPEC.buffer("conv").prefix_copy(5) == (1, 10, 10)


def test_bad_specs() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        StateSpec((BufferSpec("a", (1,), torch.float32), BufferSpec("a", (1,), torch.float32)))
    with pytest.raises(ValueError, match="seq_axis"):
        BufferSpec("a", (1, 2), torch.float32, seq_axis=2)


def test_views_alias_the_slab() -> None:
    slab = torch.zeros(3 * 4096, dtype=torch.uint8)
    views = slab_views(slab, SPEC, 3, 4096)
    assert views["k"].shape == (3, 2, 3, 16, 4)
    views["k"][1, 1, 2, 15, 3] = 1.0
    offset = 4096 + (((1 * 3 + 2) * 16 + 15) * 4 + 3) * 4
    assert slab[offset : offset + 4].view(torch.float32).item() == 1.0
    views["conv"][2, 4] = 2.0
    assert slab[2 * 4096 + 3072 + 8 : 2 * 4096 + 3072 + 10].view(torch.bfloat16).item() == 2.0


def test_table_create_is_zeroed_and_capacity_enforced() -> None:
    table = SessionTable(HostBackend(SPEC, capacity=2))
    k = table.views()["k"]
    a = table.create()
    k[a].fill_(7.0)
    b = table.create()
    assert (table.live, table.free_slots, table.spare_slot) == (2, 0, 2)
    with pytest.raises(CapacityExhausted, match="all 2 session slots"):
        table.create()
    table.free(a)
    c = table.create()
    assert c == a and torch.count_nonzero(k[c]) == 0  # reused slot comes back zeroed
    assert table.bytes_per_session == SPEC.bytes_per_session
    assert table.backend.mapped_bytes() == 3 * 4096  # two sessions + the spare
    with pytest.raises(SlotError):
        table.free(table.spare_slot)
    table.free(b)
    with pytest.raises(SlotError):
        table.free(b)


def test_clone_copies_only_the_used_prefix() -> None:
    backend = HostBackend(SPEC, capacity=3)
    views = backend.views()
    for name in ("k", "v"):
        views[name][0].copy_(torch.arange(views[name][0].numel(), dtype=torch.float32).view(2, 3, 16, 4))
        views[name][1].fill_(-1.0)
    views["conv"][0].fill_(3.0)
    backend.copy_prefix(1, 0, used=5)
    for name in ("k", "v"):
        assert torch.equal(views[name][1][:, :, :5], views[name][0][:, :, :5])
        assert bool((views[name][1][:, :, 5:] == -1.0).all())
    assert bool((views["conv"][1] == 3.0).all())


def test_table_clone_refuses_dead_source() -> None:
    table = SessionTable(HostBackend(SPEC, capacity=2))
    with pytest.raises(SlotError):
        table.clone(0, 1)
    src = table.create()
    dst = table.clone(src, 3)
    assert dst != src and table.live == 2


def test_kept_slots_are_reused_zeroed_and_released_by_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    import cuda_state.table as table_module

    clock = [100.0]
    monkeypatch.setattr(table_module.time, "monotonic", lambda: clock[0])
    backend = HostBackend(SPEC, capacity=3)
    table = SessionTable(backend, keep_mapped=2)
    k = table.views()["k"]
    slot_bytes = backend.slot_bytes
    a = table.create()
    k[a].fill_(7.0)
    table.free(a)
    assert (table.live, table.kept, table.free_slots) == (0, 1, 3)
    assert backend.mapped_bytes() == 2 * slot_bytes  # the spare and the kept slot
    b = table.create()
    assert b == a and table.kept == 0  # reused, not mapped anew
    assert torch.count_nonzero(k[b]) == 0  # and zeroed: nothing of the last session survives
    # A clone into a reused slot: the prefix is the parent's, the rest zero (not the last session's).
    c = table.create()
    k[c].fill_(5.0)
    table.free(c)
    k[b].fill_(3.0)
    d = table.clone(b, used=4)
    assert d == c
    assert (k[d][:, :, :4] == 3.0).all() and torch.count_nonzero(k[d][:, :, 4:]) == 0
    # At most keep_mapped kept: the third free unmaps.
    e = table.create()
    clock[0] = 101.0
    table.free(b)
    clock[0] = 102.0
    table.free(d)
    table.free(e)
    assert (table.live, table.kept, table.free_slots) == (0, 2, 3)
    assert backend.mapped_bytes() == 3 * slot_bytes
    clock[0] = 103.5
    assert table.trim(older_than_s=2.0) == 1  # freed at 101: released; at 102: kept
    assert (table.kept, backend.mapped_bytes()) == (1, 2 * slot_bytes)
    assert table.trim(older_than_s=2.0) == 0
    assert table.trim() == 1
    assert (table.kept, table.free_slots, backend.mapped_bytes()) == (0, 3, slot_bytes)
    assert {table.create() for _ in range(3)} == {0, 1, 2}
    with pytest.raises(CapacityExhausted):
        table.create()
    table.close()
    assert backend.mapped_bytes() == 0
