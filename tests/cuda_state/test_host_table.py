from __future__ import annotations

import pytest
import torch

from cuda_state import (
    BufferSpec,
    CapacityExhausted,
    HostBackend,
    SessionTable,
    SlotError,
    StateSpec,
    positions,
    store_positions,
)
from cuda_state.backend import slab_views

SPEC = StateSpec(
    (
        BufferSpec("k", (2, 3, 16, 4), torch.float32, seq_axis=2),
        BufferSpec("v", (2, 3, 16, 4), torch.float32, seq_axis=2),
        BufferSpec("conv", (5,), torch.bfloat16),  # fixed-size state: first in the slot, copied whole
    ),
    block_tokens=2,
)
PAGE = 1024  # 2 blocks of 384 bytes after the fixed state's 256 in the first page


def by_position(view: torch.Tensor) -> torch.Tensor:
    """One slot's K or V view (layers, heads, blocks, block, dim) as (layers, heads, positions, dim), a copy."""
    return view.flatten(2, 3)


def test_spec_layout_puts_the_fixed_state_then_blocks_of_every_buffer() -> None:
    assert SPEC.buffer("k").nbytes == 2 * 3 * 16 * 4 * 4 == 1536
    assert SPEC.buffer("k").bytes_per_token == 2 * 3 * 4 * 4 == 96
    assert SPEC.token_offset == 256  # conv's 10 bytes, aligned
    assert SPEC.token_bytes == 192  # one position of K and of V, every layer and head
    assert (SPEC.block, SPEC.block_bytes, SPEC.blocks) == (2, 2 * 192, 8)  # two positions of K, then two of V
    assert SPEC.offsets == {"conv": 0, "k": 256, "v": 256 + 2 * 96}
    assert SPEC.bytes_per_session == 256 + 8 * 384 == 3328
    assert SPEC.max_context == 16
    assert [SPEC.bytes_for(n) for n in (0, 1, 2, 5, 16, 99)] == [256, 640, 640, 1408, 3328, 3328]  # whole blocks
    assert [SPEC.pages_for(n, PAGE) for n in (0, 3, 4, 5, 9, 10, 16)] == [1, 1, 1, 2, 3, 3, 4]
    assert [SPEC.tokens_in(p, PAGE) for p in (0, 1, 2, 3, 4, 9)] == [0, 4, 8, 14, 16, 16]
    assert SPEC.view_shape("k") == (2, 3, 8, 2, 4) and SPEC.view_shape("conv") == (5,)
    # layer, head, block (a whole block of K and V), position in the block, dim
    assert SPEC.strides("k") == (3 * 2 * 4, 2 * 4, 384 // 4, 4, 1) and SPEC.strides("conv") == (1,)
    assert SPEC.slot_bytes(4096) == 4096
    assert SPEC.slot_bytes(2 << 20) == 2 << 20
    assert SPEC.fixed_bytes == 10 and not SPEC.positional
    kv = StateSpec(SPEC.buffers[:2], block_tokens=2)
    assert kv.positional and kv.fixed_bytes == 0 and kv.token_offset == 0 and kv.bytes_for(3) == 2 * 384
    assert StateSpec(SPEC.buffers[:2]).block == 16  # the default block, max_context at most
    assert StateSpec(SPEC.buffers[:2], block_tokens=64).block == 16


def test_smollm2_holds_23040_bytes_a_token_and_80_tokens_a_page() -> None:
    shape = (30, 3, 32768, 64)
    spec = StateSpec((BufferSpec("k", shape, torch.bfloat16, 2), BufferSpec("v", shape, torch.bfloat16, 2)))
    assert spec.token_bytes == 30 * 2 * 3 * 64 * 2 == 23_040
    assert spec.block == 16 and spec.block_bytes == 16 * 23_040
    assert spec.tokens_in(1, 2 << 20) == 80 and spec.pages_for(200, 2 << 20) == 3  # 5 blocks a page


def test_an_8b_llama_block_is_one_page() -> None:
    shape = (32, 8, 8192, 128)
    spec = StateSpec((BufferSpec("k", shape, torch.bfloat16, 2), BufferSpec("v", shape, torch.bfloat16, 2)))
    assert spec.block_bytes == 2 << 20 and spec.pages_for(1000, 2 << 20) == 63


def test_bad_specs() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        StateSpec((BufferSpec("a", (1,), torch.float32), BufferSpec("a", (1,), torch.float32)))
    with pytest.raises(ValueError, match="seq_axis"):
        BufferSpec("a", (1, 2), torch.float32, seq_axis=2)
    with pytest.raises(ValueError, match="one max_context"):
        StateSpec((BufferSpec("a", (1, 8), torch.float32, 1), BufferSpec("b", (1, 9), torch.float32, 1)))


def test_views_alias_the_slab() -> None:
    slab = torch.zeros(3 * 4096, dtype=torch.uint8)
    views = slab_views(slab, SPEC, 3, 4096)
    assert views["k"].shape == (3, 2, 3, 8, 2, 4)
    views["k"][1, 1, 2, 7, 1, 3] = 1.0  # slot 1, layer 1, head 2, position 15 (block 7, row 1), dim 3
    offset = 4096 + 256 + 7 * 384 + (((1 * 3 + 2) * 2 + 1) * 4 + 3) * 4
    assert slab[offset : offset + 4].view(torch.float32).item() == 1.0
    views["v"][2, 0, 0, 1, 1, 0] = 2.0  # slot 2, layer 0, head 0, position 3 (block 1, row 1): after the block's K
    offset = 2 * 4096 + 256 + 1 * 384 + 192 + 1 * 4 * 4
    assert slab[offset : offset + 4].view(torch.float32).item() == 2.0
    views["conv"][2, 4] = 3.0
    assert slab[2 * 4096 + 8 : 2 * 4096 + 10].view(torch.bfloat16).item() == 3.0


def test_positions_are_written_and_read_through_the_blocks() -> None:
    slab = torch.zeros(3 * 4096, dtype=torch.uint8)
    k = slab_views(slab, SPEC, 3, 4096)["k"][:, 1]  # layer 1, as the models pass it: (slots, heads, blocks, block, dim)
    values = torch.arange(3 * 3 * 4, dtype=torch.float32).view(3, 3, 4)
    store_positions(k, torch.tensor([1, 1, 2]), torch.tensor([0, 5, 5]), values)
    assert torch.equal(k[1, :, 2, 1], values[1]) and torch.equal(k[2, :, 2, 1], values[2])
    got = positions(k, 1, 6)
    assert got.shape == (3, 6, 4)
    assert torch.equal(got[:, 0], values[0]) and torch.equal(got[:, 5], values[1])
    assert int(torch.count_nonzero(got[:, 1:5])) == 0


def test_the_first_tokens_of_every_layer_are_the_slots_first_bytes() -> None:
    backend = HostBackend(SPEC, 2, page_bytes=PAGE)
    table = SessionTable(backend)
    slot = table.create(16)
    views = table.views()
    for name in ("k", "v"):
        store_positions(views[name][:, 0], torch.tensor([slot] * 5), torch.arange(5), torch.ones(5, 3, 4))
        store_positions(views[name][:, 1], torch.tensor([slot] * 5), torch.arange(5), torch.ones(5, 3, 4))
    views["conv"][slot].fill_(1.0)
    prefix = table.prefix(slot, 5)
    assert prefix.numel() == SPEC.bytes_for(5)
    assert int(torch.count_nonzero(backend.prefix(slot, SPEC.bytes_per_session)[prefix.numel():])) == 0
    ones = prefix[256:].view(torch.float32).view(3, 2, 2, 3, 2, 4)  # blocks, K/V, layer, head, row, dim
    assert bool((ones[:2] == 1.0).all())  # positions 0-3 of every layer and head
    assert bool((ones[2, :, :, :, 0] == 1.0).all()) and int(torch.count_nonzero(ones[2, :, :, :, 1])) == 0  # 4, not 5
    assert bool((prefix[:10].view(torch.bfloat16) == 1.0).all())  # and the fixed state before them


def test_table_create_is_zeroed_and_capacity_enforced() -> None:
    table = SessionTable(HostBackend(SPEC, capacity=2, page_bytes=PAGE))
    k = table.views()["k"]
    a = table.create(16)
    k[a].fill_(7.0)
    b = table.create()
    assert (table.live, table.free_slots, table.spare_slot) == (2, 0, 2)
    with pytest.raises(CapacityExhausted, match="all 2 session slots"):
        table.create()
    table.free(a)
    c = table.create(16)
    assert c == a and torch.count_nonzero(k[c]) == 0  # reused slot comes back zeroed
    assert table.bytes_per_session == SPEC.bytes_per_session
    assert table.backend.mapped_bytes() == (4 + 1 + 1) * PAGE  # a whole session, a first page, the spare's page
    with pytest.raises(SlotError):
        table.free(table.spare_slot)
    table.free(b)
    with pytest.raises(SlotError):
        table.free(b)


def test_sessions_grow_page_by_page_ahead_of_need_and_free_everything() -> None:
    backend = HostBackend(SPEC, capacity=3, page_bytes=PAGE)
    table = SessionTable(backend, ahead_tokens=2)
    assert (backend.page_budget, table.create_pages, table.free_pages) == (12, 1, 12)
    s = table.create()
    assert (table.pages(s), table.room(s)) == (1, 4)  # 0 + 2 ahead: one page
    table.ensure(s, 2)
    assert table.pages(s) == 1  # 2 + 2 = 4 tokens: still the first page
    table.ensure(s, 3)
    assert (table.pages(s), table.room(s)) == (2, 8)  # 3 + 2 = 5 tokens: the next page, before token 4 needs it
    table.ensure(s, 16)
    assert table.pages(s) == 4 and table.free_pages == 8  # a whole slot, no more
    table.free(s)
    assert table.free_pages == 12 and backend.mapped_pages == 0


def test_admission_is_by_free_pages() -> None:
    backend = HostBackend(SPEC, capacity=4, page_bytes=PAGE, page_budget=5)
    table = SessionTable(backend, ahead_tokens=2)
    assert table.free_slots == 4
    a = table.create(12)  # 3 pages
    assert (table.free_pages, table.free_slots) == (2, 2)
    b = table.create()
    assert (table.pages(b), table.free_slots) == (1, 1)
    with pytest.raises(CapacityExhausted, match="no free page"):
        table.create(8)  # 2 pages, one is left: refused, nothing changed
    assert (table.live, table.free_pages) == (2, 1)
    with pytest.raises(CapacityExhausted):
        table.ensure(b, 10)  # 3 pages, 1 + the free one: refused, the slot keeps what it had
    assert table.pages(b) == 1 and table.room(b) == 4
    table.ensure(b, 7)  # needs 2: the page ahead (for 9) is not to be had, the one needed is
    assert (table.pages(b), table.free_pages) == (2, 0)
    with pytest.raises(CapacityExhausted):
        table.create()
    table.free(a)
    assert table.free_slots == 3 and table.create(8) in (0, 2)


def test_clone_copies_the_fixed_state_and_the_used_prefix() -> None:
    backend = HostBackend(SPEC, capacity=3, page_bytes=PAGE)
    table = SessionTable(backend)
    src = table.create(16)
    views = backend.views()
    for name in ("k", "v"):
        views[name][src].copy_(torch.arange(1, views[name][src].numel() + 1, dtype=torch.float32).view(2, 3, 8, 2, 4))
    views["conv"][src].fill_(3.0)
    dst = table.clone(src, used=5)
    assert table.pages(dst) == 2  # the pages 5 tokens need
    for name in ("k", "v"):
        # Whole blocks are copied: positions 0-5 (the block of position 4 holds 5 too), zero after them.
        assert torch.equal(by_position(views[name][dst])[:, :, :6], by_position(views[name][src])[:, :, :6])
        assert int(torch.count_nonzero(by_position(views[name][dst])[:, :, 6:8])) == 0  # its pages hold 8
    assert bool((views["conv"][dst] == 3.0).all())
    assert bool((views["conv"][dst] == 3.0).all())


def test_table_clone_refuses_dead_source() -> None:
    table = SessionTable(HostBackend(SPEC, capacity=2, page_bytes=PAGE))
    with pytest.raises(SlotError):
        table.clone(0, 1)
    src = table.create()
    dst = table.clone(src, 3)
    assert dst != src and table.live == 2


def test_kept_slots_keep_their_pages_are_reused_zeroed_and_released_by_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    import cuda_state.table as table_module

    clock = [100.0]
    monkeypatch.setattr(table_module.time, "monotonic", lambda: clock[0])
    backend = HostBackend(SPEC, capacity=3, page_bytes=PAGE)
    table = SessionTable(backend, keep_mapped=2)
    k = table.views()["k"]
    a = table.create(16)
    k[a].fill_(7.0)
    table.free(a)
    assert (table.live, table.kept, table.free_slots) == (0, 1, 3)
    assert backend.mapped_pages == 4  # the kept slot keeps every page
    b = table.create(16)
    assert b == a and table.kept == 0 and backend.mapped_pages == 4  # reused, nothing mapped anew
    assert torch.count_nonzero(k[b]) == 0  # and zeroed: nothing of the last session survives
    # A clone into a reused slot: the prefix is the parent's, the rest zero (not the last session's).
    c = table.create(16)
    k[c].fill_(5.0)
    table.free(c)
    k[b].fill_(3.0)
    d = table.clone(b, used=2)
    assert d == c and table.pages(d) == 4 and table.surplus_pages == 3  # one page claimed, three spare
    assert (by_position(k[d])[:, :, :2] == 3.0).all() and torch.count_nonzero(by_position(k[d])[:, :, 2:]) == 0
    # At most keep_mapped kept: the third free unmaps.
    e = table.create()
    clock[0] = 101.0
    table.free(b)
    clock[0] = 102.0
    table.free(d)
    table.free(e)
    assert (table.live, table.kept, table.free_slots, table.surplus_pages) == (0, 2, 3, 0)
    assert backend.mapped_pages == 8
    clock[0] = 103.5
    assert table.trim(older_than_s=2.0) == 1  # freed at 101: released; at 102: kept
    assert (table.kept, backend.mapped_pages) == (1, 4)
    assert table.trim(older_than_s=2.0) == 0
    assert table.trim() == 1
    assert (table.kept, table.free_slots, backend.mapped_pages) == (0, 3, 0)
    assert {table.create() for _ in range(3)} == {0, 1, 2}
    with pytest.raises(CapacityExhausted):
        table.create()
    table.close()
    assert backend.mapped_bytes() == 0


def test_a_reused_slots_surplus_counts_as_free_and_goes_to_whoever_needs_pages() -> None:
    backend = HostBackend(SPEC, capacity=3, page_bytes=PAGE, page_budget=6)
    table = SessionTable(backend, keep_mapped=3, ahead_tokens=2)
    a = table.create(14)  # 14 + 2: the whole slot, 4 pages
    table.free(a)
    b = table.create(1)  # the kept slot: 4 pages, 1 claimed (1 + 2 tokens)
    assert (b, table.pages(b), table.surplus_pages) == (a, 4, 3)
    assert (table.free_pages, table.free_slots) == (2 + 3, 2)  # unmapped 2, surplus 3
    assert table.covers(b, 5)  # the session grows into its surplus: nothing mapped, the claim rises
    assert (table.pages(b), table.surplus_pages, backend.mapped_pages) == (4, 2, 4)
    c = table.create(10)  # 10 + 2 tokens: 3 pages; 2 unmapped, the third is b's surplus
    assert (table.pages(c), table.pages(b), table.surplus_pages, table.free_pages) == (3, 2, 0, 1)
    assert table.covers(b, 5) and not table.covers(b, 7)  # b keeps what its 5 tokens (+2 ahead) claimed
    d = table.create()
    assert (table.pages(d), table.free_pages, table.free_slots) == (1, 0, 0)
    with pytest.raises(CapacityExhausted):
        table.ensure(b, 12)  # 3 pages needed, none free, no surplus anywhere: b keeps its 2
    assert table.pages(b) == 2 and table.pages(c) == 3 and table.pages(d) == 1


def test_a_surplus_is_never_taken_below_what_its_session_was_backed_for() -> None:
    backend = HostBackend(SPEC, capacity=2, page_bytes=PAGE, page_budget=5)
    table = SessionTable(backend, keep_mapped=2)
    a = table.create(16)
    table.free(a)
    b = table.create(0)
    assert table.surplus_pages == 3
    table.ensure(b, 9)  # covered by the kept pages: 3 claimed
    assert table.surplus_pages == 1
    c = table.create(4)  # 1 unmapped page: enough, b is not touched
    assert (table.pages(b), table.pages(c)) == (4, 1)
    table.ensure(c, 8)  # needs 1 more: b's one surplus page
    assert (table.pages(b), table.pages(c), table.surplus_pages, table.free_pages) == (3, 2, 0, 0)
    with pytest.raises(CapacityExhausted):
        table.ensure(c, 12)
    assert table.pages(b) == 3  # the 9 positions b was backed for are never unmapped


def test_a_restore_and_a_clone_claim_the_tokens_they_copy() -> None:
    """A restore writes its tokens into the pages a reused slot already has, and a clone copies its source's first
    `used` positions: those pages hold state, so they are no surplus for another growth (here the clone's) to take."""
    backend = HostBackend(SPEC, capacity=3, page_bytes=PAGE, page_budget=6)
    table = SessionTable(backend, keep_mapped=3)
    table.free(table.create(16))  # kept with its 4 pages
    src = table.create()  # the kept slot: 4 pages, 1 claimed
    state = (torch.arange(SPEC.bytes_for(12)) % 251).to(torch.uint8)
    table.load_prefix(src, 12, state)  # a restore's copy in: 12 positions, 3 pages
    assert table.surplus_pages == 1
    child = table.clone(src, 12)  # 3 pages: the 2 unmapped and src's one surplus page
    assert (table.pages(src), table.pages(child)) == (3, 3)
    assert torch.equal(table.prefix(src, 12), state) and torch.equal(table.prefix(child, 12), state)
    with pytest.raises(CapacityExhausted):
        table.create()  # no page left, and none of src's or child's to take
    assert (table.pages(src), table.pages(child), table.live) == (3, 3, 2)


def test_a_clone_claims_its_sources_used_positions() -> None:
    backend = HostBackend(SPEC, capacity=3, page_bytes=PAGE, page_budget=6)
    table = SessionTable(backend, keep_mapped=3)
    table.free(table.create(16))
    src = table.create()  # the kept slot: 4 pages, 1 claimed
    backend.prefix(src, SPEC.bytes_for(12)).fill_(7)  # 12 positions written into its pages (as a step writes them)
    child = table.clone(src, 12)  # 3 pages: 2 unmapped, 1 of src's pages past its 12 positions
    assert (table.pages(src), table.pages(child)) == (3, 3)
    assert bool((table.prefix(child, 12) == 7).all()) and bool((table.prefix(src, 12) == 7).all())


def test_kept_slots_give_their_pages_back_when_a_growth_needs_them() -> None:
    backend = HostBackend(SPEC, capacity=3, page_bytes=PAGE, page_budget=4)
    table = SessionTable(backend, keep_mapped=3)
    a, b = table.create(), table.create()
    table.free(b)
    assert (table.kept, table.free_pages) == (1, 2)
    table.ensure(a, 16)  # 4 pages: the kept slot's page is needed
    assert (table.pages(a), table.kept, table.free_pages) == (4, 0, 0)


def test_a_refused_growth_changes_nothing_and_a_kept_slots_surplus_stays_free() -> None:
    table = SessionTable(HostBackend(SPEC, capacity=3, page_bytes=PAGE, page_budget=5), keep_mapped=3)
    a = table.create(12)  # 3 pages
    table.free(a)  # kept, mapped
    b = table.create(0)  # reuses them: 1 page claimed, 2 surplus
    c = table.create(8)  # the 2 unmapped pages
    assert (table.pages(b), table.pages(c), table.surplus_pages) == (3, 2, 2)
    before = (table.free_pages, table.free_slots, table.surplus_pages)
    with pytest.raises(CapacityExhausted):
        table.ensure(b, 16)  # 4 pages: the fifth is not to be had
    assert (table.free_pages, table.free_slots, table.surplus_pages) == before == (2, 1, 2)
    table.create(0)  # from b's surplus, as before the refused growth


@pytest.mark.parametrize("ahead", [0, 2, 6])
def test_free_slots_is_what_creates_admit_with_their_pages_ahead(ahead: int) -> None:
    table = SessionTable(HostBackend(SPEC, capacity=4, page_bytes=PAGE, page_budget=4), ahead_tokens=ahead)
    promised, made = table.free_slots, 0
    with pytest.raises(CapacityExhausted):
        for _ in range(5):
            table.create(0)
            made += 1
    assert made == promised == {0: 4, 2: 4, 6: 2}[ahead]  # 6 ahead: 2 pages a create while they last
