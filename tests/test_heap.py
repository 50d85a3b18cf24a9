"""runtime.heap: a serving process's loaded objects out of the collector's sight, and back."""
from __future__ import annotations

import gc

from splitmoe.runtime.heap import freeze_startup_heap, thaw_heap


class _Node:
    def __init__(self):
        self.me = self  # a cycle: only the collector frees it


def _nodes() -> int:
    return sum(isinstance(o, _Node) for o in gc.get_objects())


def test_frozen_objects_survive_collections_until_thawed():
    loaded = [_Node() for _ in range(1000)]
    try:
        assert freeze_startup_heap() >= 1000
        del loaded
        gc.collect()
        assert gc.get_freeze_count() >= 1000  # out of the collector's walks: the dead cycles stay
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert _nodes() == 0  # back in sight: collected
