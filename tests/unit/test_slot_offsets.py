"""HostPool.slot_offsets gives, at once, what slot_offset gives slot by slot."""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.daemon.pool.host_pool import HostPool
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
    for part in (slots, slots[:5], slots[:1], tuple(slots)):
        got = pool.slot_offsets(part)
        assert got.dtype == np.int64 and got.tolist() == [pool.slot_offset(s) for s in part]
    assert pool.slot_offsets([]).dtype == np.int64 and pool.slot_offsets([]).size == 0
    free_extent = pool.layout.n_extents - 1  # nothing was cut from the last extent
    for pad in ([], slots[:17]):
        with pytest.raises(HostPoolError, match="out of range"):
            pool.slot_offsets(pad + [slots[0], pool.layout.n_slots])
        with pytest.raises(HostPoolError, match="out of range"):
            pool.slot_offsets(pad + [-1])
        with pytest.raises(HostPoolError, match="not allocated"):
            pool.slot_offsets(pad + [free_extent * pool.layout.per_extent])


def test_slot_offsets_follow_extents_freed_and_cut_again():
    """A freed extent's slots are refused again; cut for another class, they give its offsets."""
    pool = HostPool(2 * EXTENT, EXTENT, 4 * KIB)
    small, large = pool.register_class(4 * KIB), pool.register_class(12 * KIB)
    ns = pool.namespace_id(b"n" * 32)
    first = [s for _, s in pool.allocate(ns, 1, small, [bytes([i]) * 32 for i in range(16)])]
    assert len(first) == 16 and len({s // pool.layout.per_extent for s in first}) == 1
    pool.abort(first)  # every slot back: the extent is free
    pad = first * 2
    with pytest.raises(HostPoolError, match="not allocated"):
        pool.slot_offsets(pad)
    again = [s for _, s in pool.allocate(ns, 1, large, [bytes([i + 100]) * 32 for i in range(5)])]
    assert again and set(again) <= set(first)
    got = pool.slot_offsets(again * 17)
    assert got.tolist() == [pool.slot_offset(s) for s in again] * 17
    leftover = [s for s in first if s % pool.layout.per_extent >= 5]  # past the large class's cut
    with pytest.raises(HostPoolError, match="not allocated"):
        pool.slot_offsets(again * 16 + leftover[:1])


def test_slot_offsets_refuse_what_is_not_a_slot_and_name_it():
    """An id too large for any integer column, or not an int, is refused, never read."""
    pool = HostPool(2 * EXTENT, EXTENT, 4 * KIB)
    c = pool.register_class(4 * KIB)
    ns = pool.namespace_id(b"n" * 32)
    slots = [s for _, s in pool.allocate(ns, 1, c, [bytes([i]) * 32 for i in range(4)])]
    with pytest.raises(HostPoolError, match=f"slot {1 << 70} out of range"):
        pool.slot_offsets([*slots, 1 << 70])
    with pytest.raises(HostPoolError, match=f"slot {-(1 << 70)} out of range"):
        pool.slot_offsets([-(1 << 70)])
    with pytest.raises(TypeError):
        pool.slot_offsets([slots[0], "3"])  # type: ignore[list-item]
