"""freeze_heap: what is alive when a process freezes leaves the collector's generations; what comes later is still
collected, reference cycles included."""

from __future__ import annotations

import gc
import weakref

from spec_batch.heap import freeze_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_heap_moves_the_live_heap_out_and_later_cycles_are_still_collected():
    before = _Cycle()
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # frozen: no generation holds it any more
        later = _Cycle()
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()  # the test process goes on collecting as before
