"""HostPool.slot_offsets gives, at once, what slot_offset gives slot by slot."""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.daemon.pool.index import HostPool
from kvtier.daemon.pool.records import HostPoolError

KIB = 1024
EXTENT = 64 * KIB


@pytest.mark.parametrize("headroom", [0, 4096])
def test_slot_offsets_match_slot_offset_across_classes(headroom):
    pool = HostPool(8 * EXTENT, EXTENT, 4 * KIB, headroom=headroom)
    slots = []
    for cid, size in enumerate((4 * KIB, 12 * KIB)):
        c = pool.register_class(size)
        ns = pool.namespace_id(bytes([cid + 1]) * 32)
        got = pool.allocate(ns, 1, c, [bytes([cid, i]) * 16 for i in range(9)], None)
        slots += [s for _, s in got]
    slots = slots[::-1]
    want = [pool.slot_offset(s) for s in slots]
    assert pool.slot_offsets(slots).tolist() == want
    assert pool.slot_offsets([]).dtype == np.int64
    with pytest.raises(HostPoolError):
        pool.slot_offsets([slots[0], pool.layout.n_slots])
