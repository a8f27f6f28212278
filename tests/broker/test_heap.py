"""heap.settle: the start-up heap is frozen (full collections skip it) and the switch interval is set."""

from __future__ import annotations

import gc
import sys

from broker.common import heap


def test_settle_freezes_what_is_alive_and_sets_the_switch_interval() -> None:
    before = sys.getswitchinterval()
    alive: list[list[object]] = [[] for _ in range(1000)]  # lists are tracked by the collector
    try:
        heap.settle(heap.SWITCH_INTERVAL_S)
        assert gc.get_freeze_count() >= len(alive)
        assert abs(sys.getswitchinterval() - heap.SWITCH_INTERVAL_S) < 1e-9
        frozen = gc.get_freeze_count()
        later: list[list[object]] = [[] for _ in range(1000)]
        assert all(gc.is_tracked(x) for x in later) and gc.get_freeze_count() == frozen  # new objects are not frozen
    finally:
        gc.unfreeze()
        sys.setswitchinterval(before)


def test_settle_leaves_the_switch_interval_alone_by_default() -> None:
    before = sys.getswitchinterval()
    try:
        heap.settle()
        assert sys.getswitchinterval() == before
    finally:
        gc.unfreeze()
