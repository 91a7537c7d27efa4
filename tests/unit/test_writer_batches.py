"""The L3 writer's write-through batches, in-process over a real host pool and the real
``file`` backend: a batch pins all its pages for the write (in one call where it can) and
lets every pin go after; a page that left L2 before its batch ran is dropped while the rest
of the batch is written; a SYNC counts each page once, written or not.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvtier.daemon.tier.guard import L3Backend
from kvtier.daemon.tier.writer import L3Writer

from tests.unit.test_tier_store import GEOMETRY, Rig, chain, open_rig
from tests.unit.test_writer import PassThrough, running

pytestmark = pytest.mark.timeout(30)


class PinsSeen(PassThrough):
    """The tier's guarded backend, recording the pin count of each page it is asked to put."""

    def __init__(self, inner: L3Backend, rig: Rig) -> None:
        super().__init__(inner)
        self.rig = rig
        self.pins: dict[int, int] = {}  # arena offset -> pins while the put ran

    async def put(
        self, ns: bytes, keys: list[bytes], offsets: list[int], length: int
    ) -> list[bool]:
        pool = self.rig.pool
        by_offset = {
            pool.slot_offset(s): s for s in range(pool.n_slots) if pool.describe(s).key is not None
        }
        self.pins.update((off, pool.describe(by_offset[off]).pins) for off in offsets)
        return await self.inner.put(ns, keys, offsets, length)


def store_as(rig: Rig, owner: int, keys: list[bytes]) -> list[int]:
    """Commit ``keys`` (one chain) in L2 for ``owner``; their slots."""
    s = rig.session
    pairs = rig.pool.allocate(s.ns_id, owner, s.class_id, keys, None)
    assert len(pairs) == len(keys)
    for _, slot in pairs:
        off = rig.pool.slot_offset(slot)
        rig.arena.view[off : off + GEOMETRY.page_bytes] = os.urandom(GEOMETRY.page_bytes)
    rig.pool.commit([slot for _, slot in pairs])
    return [slot for _, slot in pairs]


async def test_a_batch_writes_around_a_page_gone_from_l2(tmp_path: Path) -> None:
    """One batch [B0, B1, A0, B2, B3]: A0 leaves L2 before the batch runs. B's four pages
    are written and marked in L3, A0 is dropped; a SYNC waiting on all five counts four
    written and one not; no pin is left behind."""
    async with open_rig(tmp_path, run=False) as rig:
        s, c = rig.session, rig.counters
        other = rig.pool.owner_id("another tenant")
        b, a = chain(4, salt="b "), chain(1, salt="a ")
        b_slots = store_as(rig, s.owner, b)
        store_as(rig, other, a)
        seen = PinsSeen(rig.tier.l3, rig)
        writer = L3Writer(rig.cfg, seen, rig.tier, rig.pool, c)
        for keys in (b[:2], a, b[2:]):  # queued in this order: one batch of five
            writer.committed(s.ns_fingerprint, s.ns_id, keys, GEOMETRY.page_bytes)
        assert writer.queued == 5
        assert rig.pool.flush(owner=other) == 1  # A0 is gone from L2
        async with running(writer):
            assert await writer.sync(10.0) == (5, 4, 1, 0)
        assert seen.pins == {rig.pool.slot_offset(x): 1 for x in b_slots}  # pinned in the put
        assert c.l3_write_written_pages == 4 and c.l3_write_dropped_pages == 1
        assert rig.backend.stats.puts == 4 and writer.queued == 0
        assert await rig.tier.l3.exists(s.ns_fingerprint, b) == 4
        assert await rig.tier.l3.exists(s.ns_fingerprint, a) == 0
        infos = [rig.pool.describe(x) for x in b_slots]
        assert all(i.in_l3 and i.pins == 0 for i in infos)
        assert rig.pool.flush(s.ns_id) == 4  # unpinned: every page evictable again


async def test_a_batch_whose_pages_are_all_gone_writes_nothing(tmp_path: Path) -> None:
    async with open_rig(tmp_path, run=False) as rig:
        s, c = rig.session, rig.counters
        keys = chain(3)
        rig.store(keys)
        writer = L3Writer(rig.cfg, rig.tier.l3, rig.tier, rig.pool, c)
        writer.committed(s.ns_fingerprint, s.ns_id, keys, GEOMETRY.page_bytes)
        assert rig.pool.flush(s.ns_id) == 3
        async with running(writer):
            assert await writer.sync(10.0) == (3, 0, 3, 0)
        assert c.l3_write_dropped_pages == 3 and rig.backend.stats.puts == 0
        assert writer.queued == 0
