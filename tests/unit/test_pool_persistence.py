"""Exact tests of the host pool's persistence: crash, then adopt from the same files.

A "crash" drops the pool object without any cleanup and maps the pool file again, as a
restarted daemon would (the old mapping is left alone, as a killed process's would be).
No mocks: pools live over real mmaps of temp files, and crash states between write
steps are made by writing the metadata bytes directly, as a crash would leave them.

Geometry as in test_host_pool: align 4 KiB, extents of 16 KiB (4 slot ids each); class
"small" (4000 B pages) has a 4 KiB stride and 4 slots per extent.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from kvtier.daemon.pool.host_pool import NIL, AdoptResult, HostPool, HostPoolError, PageState
from kvtier.daemon.pool.layout import (
    FORMAT_VERSION,
    HAS_CHECKSUM,
    KEY_BYTES,
    SLOT_META_BYTES,
    IdTable,
    PoolLayout,
    map_pool_file,
    page_checksum,
    page_checksums,
    seal_of,
)
from kvtier.daemon.pool.meta import PoolMeta

from tests.unit.test_host_pool import CLASS_BYTES, MACHINE_SETTINGS, PoolMachine
from tests.xxh3_reference import xxh3_64

KIB = 1024
EXTENT = 16 * KIB
SMALL = 4000
NS, NS2 = 1, 2
A, B = 10, 20


def k(name: str) -> bytes:
    return name.encode()


def chain(prefix: str, n: int) -> list[bytes]:
    return [k(f"{prefix}{i}") for i in range(n)]


def new_pool(layout: PoolLayout, **kwargs: Any) -> HostPool:
    """A pool of ``layout``'s geometry (``kwargs``: ``meta``, ``arena``, ``cold_start``,
    ``classes``: built over metadata, as the daemon builds it over its pool file)."""
    return HostPool(layout.capacity_bytes, layout.extent_bytes, layout.align, **kwargs)


def opened(layout: PoolLayout, meta: Any, **kwargs: Any) -> tuple[HostPool, AdoptResult]:
    """A pool of ``layout`` built over ``meta``, and what it adopted."""
    pool = new_pool(layout, meta=meta, **kwargs)
    assert pool.adopted is not None
    return pool, pool.adopted


class PoolFile:
    """A pool file in a temp dir; every :meth:`start` maps it again, like a new process."""

    def __init__(self, path: Path, layout: PoolLayout, copy_of: Path | None = None) -> None:
        self.path, self.layout = path, layout
        if copy_of is not None:
            shutil.copyfile(copy_of, path)
        else:
            with open(path, "wb") as f:
                f.truncate(layout.file_bytes)
        self.maps: list[mmap.mmap] = []

    def copy(self, path: Path) -> PoolFile:
        """A copy of the file as it is now (a crash state to try)."""
        return PoolFile(path, self.layout, copy_of=self.path)

    def map(self) -> memoryview:
        """A fresh shared mapping of the whole file."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, self.layout.file_bytes)
        finally:
            os.close(fd)
        self.maps.append(mm)
        return memoryview(mm)

    def start(
        self,
        layout: PoolLayout | None = None,
        *,
        verify: bool = True,
        cold_start: bool | str = False,
    ) -> tuple[HostPool, AdoptResult]:
        """Map the file and open a pool over it (the daemon's start)."""
        lay = layout or self.layout
        view = self.map()
        arena = view[lay.arena_offset : lay.arena_offset + lay.capacity_bytes]
        return opened(
            lay, view[: lay.meta_bytes], arena=arena if verify else None, cold_start=cold_start
        )

    def arena(self) -> memoryview:
        lay = self.layout
        return self.map()[lay.arena_offset : lay.arena_offset + lay.capacity_bytes]

    def meta(self) -> PoolMeta:
        """Low-level access to the metadata, to write it as a crash would leave it."""
        return PoolMeta(self.map()[: self.layout.meta_bytes], self.layout)


@pytest.fixture
def pool_file(tmp_path: Path) -> PoolFile:
    return PoolFile(tmp_path / "pool", PoolLayout.plan(3 * EXTENT, EXTENT, 4 * KIB))


def payload(key: bytes, nbytes: int = SMALL) -> bytes:
    """Page bytes that name their key, so a mix-up shows."""
    return (key * (nbytes // len(key) + 1))[:nbytes]


def store(
    pool: HostPool,
    arena: memoryview,
    keys: list[bytes],
    ns: int = NS,
    owner: int = A,
    parent: bytes | None = None,
    checksums: bool = True,
) -> list[int]:
    """Allocate ``keys``, write their payloads into the arena, commit with checksums."""
    got = pool.allocate(ns, owner, pool.register_class(SMALL), keys, parent)
    slots = [s for _, s in got]
    for i, s in got:
        off = pool.slot_offset(s)
        arena[off : off + SMALL] = payload(keys[i])
    offsets = [pool.slot_offset(s) for s in slots]
    pool.commit(slots, page_checksums(arena, offsets, SMALL) if checksums else None)
    return slots


def unmarked(rows: dict[int, tuple]) -> dict[int, tuple]:
    """``rows`` with every in-L3 flag cleared, as adoption leaves them."""
    return {s: (*r[:5], False, *r[6:]) for s, r in rows.items()}


def rows(pool: HostPool) -> dict[int, tuple]:
    """What must survive: per READY slot, key, ns, owner, class page size, offset, in-L3
    flag (cleared by adoption: compare with :func:`unmarked`), last access and parent."""
    out = {}
    for s in range(pool.n_slots):
        d = pool.describe(s)
        if d.state is PageState.READY:
            page_bytes = pool.stats().classes[d.class_id].page_bytes
            out[s] = (
                d.key,
                d.ns_id,
                d.owner,
                page_bytes,
                d.offset,
                d.in_l3,
                d.last_access,
                d.parent,
            )
    return out


# ------------------------------------------------------------------ layout


def test_layout_geometry_and_a_fresh_file_starts_empty(pool_file: PoolFile) -> None:
    lay = pool_file.layout
    assert (lay.n_extents, lay.per_extent, lay.n_slots) == (3, 4, 12)
    assert lay.meta_bytes == lay.arena_offset == 2 << 20
    assert lay.file_bytes == lay.meta_bytes + 3 * EXTENT
    offsets = [off for _, _, off in lay.columns]
    assert offsets == sorted(offsets) and all(off % 64 == 0 for off in offsets)
    assert SLOT_META_BYTES == 88 and offsets[-1] + 12 <= lay.meta_bytes
    pool, res = pool_file.start()
    assert (res.adopted, res.reason, res.generation) == (
        False,
        "no pool metadata (new pool file)",
        1,
    )
    assert "started empty" in res.summary and res.reason in res.summary
    assert pool.stats().pages_ready == 0
    _, res = pool_file.start()
    assert (res.adopted, res.generation, res.pages_adopted) == (True, 2, 0)
    _, res = pool_file.start()
    assert res.generation == 3
    with pytest.raises(HostPoolError, match="needs"):
        new_pool(lay, meta=bytearray(lay.meta_bytes - 1))
    with pytest.raises(HostPoolError, match="read-only"):
        new_pool(lay, meta=bytes(lay.meta_bytes))


# ------------------------------------------------------------ crash, adopt


def test_crash_then_adopt_keeps_ready_pages_drops_writing_and_pins(pool_file: PoolFile) -> None:
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    a = store(pool, arena, chain("a", 3))
    b = store(pool, arena, chain("b", 2), ns=NS2, owner=B)
    w = [s for _, s in pool.allocate(NS, A, 0, [k("a3"), k("a4")], parent_key=k("a2"))]
    pool.pin(NS, chain("a", 2))
    pool.mark_in_l3([b[1]])
    before = rows(pool)
    assert set(before) == set(a + b) and pool.describe(a[2]).children == 1
    del pool  # the crash: no close, no cleanup

    pool, res = pool_file.start()
    assert (res.adopted, res.pages_adopted, res.pages_dropped) == (True, 5, 2)
    assert (res.bytes_adopted, res.generation) == (5 * SMALL, 2)
    assert "adopted (generation 2): 5 pages" in res.summary
    # same keys, namespaces, owners, offsets, stamps, links; no page stays marked in L3
    # (the store may have changed while no daemon ran: the writer asks it again)
    assert before[b[1]][5] and rows(pool) == unmarked(before)
    assert all(pool.describe(s).state is PageState.FREE for s in w)
    assert pool.lookup(NS, chain("a", 5)) == 3 and pool.lookup(NS2, chain("b", 2)) == 2
    assert pool.lookup(NS2, chain("a", 3)) == 0
    st0 = pool.stats()
    assert (st0.pages_ready, st0.pages_writing, st0.pages_pinned) == (5, 0, 0)
    assert (pool.owned_pages(A), pool.owned_pages(B)) == (3, 2)
    assert [pool.describe(s).children for s in a] == [1, 1, 0]  # a3 (WRITING) is gone
    assert [pool.describe(s).children for s in b] == [1, 0]
    assert pool.evictable_slots() == [a[2], b[1]]  # pins dropped: a's tail is evictable
    for s, (key, *_rest) in before.items():
        off = pool.slot_offset(s)
        assert bytes(arena[off : off + SMALL]) == payload(key)
        assert pool.describe(s).checksum == xxh3_64(payload(key))
    # the adopted pool works on: the freed WRITING slots are reused, lowest first
    assert pool.allocate(NS, A, pool.register_class(SMALL), [k("a3")], k("a2")) == [(0, w[0])]


def test_eviction_order_survives_and_matches_a_pool_that_never_crashed(
    pool_file: PoolFile,
) -> None:
    twin = HostPool(3 * EXTENT, EXTENT, 4 * KIB)  # the same operations, never crashed
    twin_arena = memoryview(bytearray(3 * EXTENT))
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    for p, ar in ((pool, arena), (twin, twin_arena)):
        x = store(p, ar, chain("x", 3))
        y = store(p, ar, chain("y", 3), owner=B)
        z = store(p, ar, chain("z", 2))
        p.unpin(p.pin(NS, chain("x", 3)))  # x becomes the most recent chain
    order = pool.evictable_slots()
    assert order == twin.evictable_slots() == [y[2], z[1], x[2]]  # tails, coldest first
    del pool

    pool, _ = pool_file.start()
    assert pool.evictable_slots() == order
    assert pool.evictable_slots(A) == twin.evictable_slots(A) == [z[1], x[2]]
    assert pool.evictable_slots(B) == twin.evictable_slots(B) == [y[2]]
    got = [p.allocate(NS, A, p.register_class(SMALL), chain("w", 9)) for p in (pool, twin)]
    assert got[0] == got[1] == list(enumerate([8, 9, 10, 11, y[2], y[1], y[0], z[1], z[0]]))
    evicted = [[e.key for e in p.drain_evicted()] for p in (pool, twin)]
    assert evicted[0] == evicted[1] == [k(n) for n in ("y2", "y1", "y0", "z1", "z0")]


def test_namespace_and_owner_ids_persist(pool_file: PoolFile) -> None:
    fp1, fp2, fp3 = (bytes([i]) * 32 for i in (1, 2, 3))
    pool, _ = pool_file.start()
    assert (pool.namespace_id(fp1), pool.namespace_id(fp2), pool.namespace_id(fp1)) == (1, 2, 1)
    assert (pool.owner_id("alice"), pool.owner_id("bob")) == (1, 2)
    store(pool, pool_file.arena(), chain("a", 2), ns=2, owner=2)
    with pytest.raises(HostPoolError, match="32 bytes"):
        pool.namespace_id(b"short")
    del pool

    pool, res = pool_file.start()
    assert res.pages_adopted == 2
    assert pool.namespaces() == {fp1: 1, fp2: 2}
    assert (pool.namespace_id(fp2), pool.namespace_id(fp3)) == (2, 3)
    assert (pool.owner_id("bob"), pool.owner_id("carol"), pool.owner_id("alice")) == (2, 3, 1)
    assert pool.lookup(pool.namespace_id(fp2), chain("a", 2)) == 2
    assert pool.owned_pages(pool.owner_id("bob")) == 2
    pool.set_quota(pool.owner_id("bob"), 2)  # quotas are config: set again after a start
    assert pool.allocate(2, 2, pool.register_class(SMALL), [k("a2")], k("a1")) == []
    del pool
    pool, _ = pool_file.start(cold_start=True)  # a discard resets the tables too
    assert pool.namespaces() == {} and pool.owner_id("bob") == 1


def test_id_tables_fill_up() -> None:
    lay = PoolLayout.plan(EXTENT, EXTENT, 4 * KIB, id_capacity=2)
    meta = PoolMeta(bytearray(lay.meta_bytes), lay)
    ns = IdTable.NAMESPACES
    assert [meta.id_of(ns, bytes([i]) * 32) for i in (1, 2, 1)] == [1, 2, 1]
    with pytest.raises(HostPoolError, match="namespaces table is full"):
        meta.id_of(ns, bytes([3]) * 32)
    assert [meta.id_of(IdTable.OWNERS, bytes([i]) * 32) for i in (7, 8)] == [1, 2]
    with pytest.raises(HostPoolError, match="owners table is full"):
        meta.id_of(IdTable.OWNERS, bytes(32))
    assert meta.ids(ns) == {bytes([1]) * 32: 1, bytes([2]) * 32: 2}


def test_an_adopted_pool_keeps_the_classes_it_is_built_with(pool_file: PoolFile) -> None:
    """Page sizes given to the constructor keep their class ids; an adoption registers its
    extents' other sizes after them; a too-small arena is refused before anything is built;
    quotas and the write-back hook apply to the adopted pages."""
    pool, _ = pool_file.start()
    store(pool, pool_file.arena(), chain("a", 2))
    pool.close()
    view = pool_file.map()
    lay = pool_file.layout
    with pytest.raises(HostPoolError, match="the arena has 100 bytes, the pool needs 49152"):
        new_pool(lay, meta=view[: lay.meta_bytes], arena=bytearray(100))
    pool, res = opened(
        lay, view[: lay.meta_bytes], arena=view[lay.arena_offset :], classes=[3 * SMALL]
    )
    assert (res.adopted, res.pages_adopted) == (True, 2)
    assert pool.register_class(3 * SMALL) == 0  # the ids given first stay valid
    assert pool.register_class(SMALL) == 1 and pool.lookup(NS, chain("a", 2)) == 2
    pool.set_quota(A, 3)
    pool.evict_requires_l3 = True
    assert pool.allocate(NS, A, 1, [k("a2")], k("a1")) == [(0, 2)]
    assert pool.allocate(NS, A, 1, [k("a3")], k("a2")) == []  # quota 3, nothing in L3
    assert pool.layout == lay


# --------------------------------------------------------------- discards


GEOMETRY = "geometry changed: "
DISCARDS = {
    "capacity": GEOMETRY + "capacity_bytes 49152 -> 65536, extents 3 -> 4, slots 12 -> 16",
    "extent": GEOMETRY + "extent_bytes 16384 -> 8192, slot ids per extent 4 -> 2, extents 3 -> 6",
    "align": GEOMETRY + "align 4096 -> 8192, slot ids per extent 4 -> 2, slots 12 -> 6",
    "version": f"metadata format version {FORMAT_VERSION + 1}, this build reads {FORMAT_VERSION}",
    "magic": "not a kvtier pool header (magic b'KVTPOOL\\xff')",
    "geometry byte": "pool header checksum mismatch (corrupted header)",
    "format interrupted": "pool metadata incomplete (a format was interrupted)",
    "cold": "cold start requested",
    "cold why": "operator asked",
}


@pytest.mark.parametrize(("change", "reason"), list(DISCARDS.items()))
def test_a_header_that_does_not_match_discards_everything(
    pool_file: PoolFile, change: str, reason: str
) -> None:
    pool, _ = pool_file.start()
    store(pool, pool_file.arena(), chain("a", 3))
    pool.namespace_id(b"n" * 32)
    del pool
    lay = pool_file.layout
    layouts = {
        "capacity": PoolLayout.plan(4 * EXTENT, EXTENT, 4 * KIB),
        "extent": PoolLayout.plan(3 * EXTENT, EXTENT // 2, 4 * KIB),
        "align": PoolLayout.plan(3 * EXTENT, EXTENT, 8 * KIB),
    }
    view = pool_file.map()
    if change == "version":
        struct.pack_into("<I", view, 8, FORMAT_VERSION + 1)
    elif change == "magic":
        view[7] = 0xFF
    elif change == "geometry byte":
        view[16] ^= 1  # a bit of capacity_bytes, checksum left as it was
    elif change == "format interrupted":
        view[:8] = bytes(8)  # format() clears the magic first and writes it last
    new_layout = layouts.get(change, lay)
    if new_layout.file_bytes > lay.file_bytes:
        with open(pool_file.path, "r+b") as f:
            f.truncate(new_layout.file_bytes)
        pool_file.layout = new_layout
    colds: dict[str, bool | str] = {"cold": True, "cold why": "operator asked"}
    cold = colds.get(change, False)
    pool, res = pool_file.start(new_layout, cold_start=cold)
    assert (res.adopted, res.reason, res.pages_adopted, res.generation) == (False, reason, 0, 1)
    assert pool.lookup(NS, chain("a", 3)) == 0 and pool.namespaces() == {}
    assert pool.stats().extents_free == new_layout.n_extents
    del pool
    _, res = pool_file.start(new_layout)  # the header was rewritten for the new layout
    assert (res.adopted, res.generation, res.pages_adopted) == (True, 2, 0)


def test_map_pool_file_keeps_a_matching_file_and_replaces_another(tmp_path: Path) -> None:
    path = tmp_path / "kvtier-pool-x"
    lay = PoolLayout.plan(3 * EXTENT, EXTENT, 4 * KIB)
    seg, why = map_pool_file(path, lay, prefault=False)
    assert why == "no pool file (first start)" and seg.size == lay.file_bytes
    pool, res = opened(lay, seg.view[: lay.meta_bytes], cold_start=why)
    assert res.reason == why
    arena = seg.view[lay.arena_offset :]
    store(pool, arena, chain("a", 2))
    pool.close()
    arena.release()
    seg.close()
    assert path.exists()  # closing keeps the pool for the next start

    seg, why = map_pool_file(path, lay, prefault=True)
    assert why is None
    pool, res = opened(lay, seg.view[: lay.meta_bytes], arena=seg.view[lay.arena_offset :])
    assert (res.adopted, res.pages_adopted) == (True, 2)
    pool.close()
    seg.close()

    bigger = PoolLayout.plan(4 * EXTENT, EXTENT, 4 * KIB)
    seg, why = map_pool_file(path, bigger, prefault=False)
    assert why == "geometry changed: capacity_bytes 49152 -> 65536, extents 3 -> 4, slots 12 -> 16"
    assert seg.size == bigger.file_bytes
    seg.close()
    with open(path, "r+b") as f:
        f.truncate(5000)  # not even a header's worth of pool
    seg, why = map_pool_file(path, bigger, prefault=False)
    assert why == f"pool file has 5000 bytes, expected {bigger.file_bytes}"
    seg.close(unlink=True)
    assert not path.exists()


# ---------------------------------------------------------- verification


def test_a_page_whose_bytes_changed_after_commit_is_dropped(pool_file: PoolFile) -> None:
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    a = store(pool, arena, chain("a", 3))
    off = pool.slot_offset(a[1])
    del pool
    arena[off + 100] ^= 0xFF  # a stray write into a READY page's payload

    pool, res = pool_file.start(verify=False)  # unverified: trusted as it is
    assert (res.pages_adopted, res.pages_dropped) == (3, 0)
    del pool
    pool, res = pool_file.start()
    assert (res.pages_adopted, res.pages_dropped) == (2, 1)
    assert pool.describe(a[1]).state is PageState.FREE
    assert pool.lookup(NS, chain("a", 3)) == 1
    assert pool.describe(a[2]).parent == NIL  # its parent is gone: an orphan, still valid
    assert pool.lookup(NS, [k("a2")]) == 1
    assert pool.describe(a[0]).children == 0 and pool.evictable_slots() == [a[2], a[0]]


def test_pages_committed_without_checksum_are_adopted_only_unverified(pool_file: PoolFile) -> None:
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    store(pool, arena, chain("a", 2), checksums=False)
    store(pool, arena, chain("b", 1))
    with pytest.raises(HostPoolError, match="one 64-bit checksum per slot"):
        pool.commit([s for _, s in pool.allocate(NS, A, 0, [k("c")])], [1, 2])
    with pytest.raises(HostPoolError, match="one 64-bit checksum per slot"):
        pool.commit([pool.describe(3).slot], [-1])
    del pool
    pool, res = pool_file.start(verify=False)
    assert (res.pages_adopted, res.pages_dropped) == (3, 1)
    del pool
    pool, res = pool_file.start()
    assert (res.pages_adopted, res.pages_dropped) == (1, 2)
    assert pool.lookup(NS, [k("b0")]) == 1 and pool.lookup(NS, [k("a0")]) == 0


def test_keys_longer_than_the_key_column_are_refused_before_any_change() -> None:
    pool = HostPool(EXTENT, EXTENT, 4 * KIB)
    small = pool.register_class(SMALL)
    with pytest.raises(HostPoolError, match="at most 32 bytes"):
        pool.allocate(NS, A, small, [k("ok"), bytes(KEY_BYTES + 1)])
    assert pool.stats().pages_writing == 0
    assert pool.allocate(NS, A, small, [bytes(KEY_BYTES)]) == [(0, 0)]


def test_page_checksums_of_the_pool_file_s_arena(pool_file: PoolFile) -> None:
    arena = pool_file.arena()
    arena[4096:8192] = bytes(range(256)) * 16
    assert page_checksums(arena, [0, 4096], 4096) == [  # the tests' own XXH3
        xxh3_64(bytes(4096)),
        xxh3_64(bytes(range(256)) * 16),
    ]


# ------------------------------------------------------ crash between writes


ROW_FIELDS = (
    "key",
    "key_len",
    "ns",
    "owner",
    "length",
    "parent",
    "checksum",
    "flags",
    "seal",
    "state",
    "in_l3",
)


def row(meta: PoolMeta, s: int) -> tuple:
    """Every persistent field of slot ``s`` but its stamp."""
    return tuple(
        bytes(meta.key[s * KEY_BYTES : (s + 1) * KEY_BYTES]) if f == "key" else getattr(meta, f)[s]
        for f in ROW_FIELDS
    )


def test_a_crash_between_any_two_writes_never_adopts_a_page_under_a_wrong_key(
    pool_file: PoolFile, tmp_path: Path
) -> None:
    """Slot reuse step by step: evict page K0, allocate K1 into its slot, copy K1's bytes,
    commit. Every prefix of the write sequence (and torn or missing writes) is a crash
    state; adopting it shows K0 with K0's bytes, or K1 with K1's bytes, or neither."""
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    k0, k1 = k("K0"), k("K1-new")
    (s,) = store(pool, arena, [k0], ns=NS, owner=A)
    (p,) = store(pool, arena, [k("P")], ns=NS2, owner=B)  # the parent K1 will extend
    off = pool.slot_offset(s)
    del pool
    csum1 = page_checksum(payload(k1))
    steps: list[tuple[str, Any]] = [
        ("state", PageState.FREE),  # release: the state byte first
        ("in_l3", 0),
        ("parent", NIL),
        ("key", k1),  # allocate: the row, then the state byte
        ("ns", NS2),
        ("owner", B),
        ("length", SMALL),
        ("parent", p),
        ("stamp", 99),
        ("state", PageState.WRITING),
        ("payload", payload(k1)),  # the copy thread
        ("checksum", csum1),  # commit: checksum, flags, seal, stamp, then the state byte
        ("flags", HAS_CHECKSUM),
        ("seal", seal_of(k1, NS2, csum1)),
        ("stamp", 100),
        ("state", PageState.READY),
    ]
    torn = ("torn key", k1[:3])  # the first bytes of K1 over K0's, its length not yet
    cases = [steps[:n] for n in range(len(steps) + 1)]
    cases.append(steps[:3] + [torn])
    cases.append(steps[:3] + [torn] + steps[4:])  # even if the rest of the row landed
    cases.append([st for st in steps if st[0] != "seal"])
    for i, case in enumerate(cases):
        for verify in (True, False):
            f = pool_file.copy(tmp_path / f"crash-{i}-{verify}")
            meta, ar = f.meta(), f.arena()
            for name, value in case:
                if name == "payload":
                    ar[off : off + SMALL] = value
                elif name == "key":
                    meta.put_key(s, value)
                elif name == "torn key":
                    meta.key[s * KEY_BYTES : s * KEY_BYTES + 3] = value
                else:
                    getattr(meta, name)[s] = value
            meta.release()
            pool, _ = f.start(verify=verify)
            d = pool.describe(s)
            visible = {
                key
                for key in (k0, k1, k("K1"))
                if pool.lookup(NS, [key]) or pool.lookup(NS2, [key])
            }
            if case == steps[: len(case)] and len(case) == 0:
                assert visible == {k0} and bytes(ar[off : off + SMALL]) == payload(k0)
            elif case == steps:
                assert visible == {k1} and bytes(ar[off : off + SMALL]) == payload(k1)
                assert (d.ns_id, d.owner, d.parent) == (NS2, B, p)
            else:
                assert visible == set() and d.state is PageState.FREE, (i, verify, case)
            pool.close()

    # The sequence is the real one: the pool itself leaves the same row.
    f = pool_file.copy(tmp_path / "replayed")
    meta = f.meta()
    for name, value in steps:
        if name == "key":
            meta.put_key(s, value)
        elif name != "payload":
            getattr(meta, name)[s] = value
    replayed = row(meta, s)
    meta.release()
    pool, _ = pool_file.start()
    assert pool.flush(ns_id=NS) == 1
    assert store(pool, pool_file.arena(), [k1], ns=NS2, owner=B, parent=k("P")) == [s]
    pool.close()
    meta = pool_file.meta()
    assert row(meta, s) == replayed
    meta.release()


def test_a_half_committed_batch_adopts_only_its_committed_tail(pool_file: PoolFile) -> None:
    """commit() flips pages tail first: a crash half-way leaves the tail READY and the
    head WRITING; the head is dropped, the tail survives as an orphan."""
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    keys = chain("h", 3)
    slots = [s for _, s in pool.allocate(NS, A, pool.register_class(SMALL), keys)]
    for s, key in zip(slots, keys):
        arena[pool.slot_offset(s) : pool.slot_offset(s) + SMALL] = payload(key)
    del pool
    meta = pool_file.meta()
    tail = slots[2]
    csum = page_checksum(payload(keys[2]))
    meta.checksum[tail], meta.flags[tail] = csum, HAS_CHECKSUM
    meta.seal[tail] = seal_of(keys[2], NS, csum)
    meta.state[tail] = PageState.READY
    mid = slots[1]  # its row written, the crash came before its state byte
    meta.checksum[mid], meta.flags[mid] = page_checksum(payload(keys[1])), HAS_CHECKSUM
    meta.seal[mid] = seal_of(keys[1], NS, meta.checksum[mid])
    meta.release()
    pool, res = pool_file.start()
    assert (res.pages_adopted, res.pages_dropped) == (1, 2)
    assert pool.lookup(NS, [keys[2]]) == 1 and pool.lookup(NS, keys) == 0
    assert pool.describe(tail).parent == NIL and pool.evictable_slots() == [tail]


def test_a_crash_mid_release_leaves_no_stale_in_l3_flag(pool_file: PoolFile) -> None:
    """release() flips the state byte first and clears the in-L3 flag after: a crash in
    between must not hand the flag to the next page of that slot."""
    pool, _ = pool_file.start()
    (s,) = store(pool, pool_file.arena(), [k("old")])
    pool.mark_in_l3([s])
    del pool
    meta = pool_file.meta()
    meta.state[s] = PageState.FREE  # the crash came right after this write
    meta.release()
    pool, res = pool_file.start()
    assert res.pages_adopted == 0
    assert store(pool, pool_file.arena(), [k("new")]) == [s]
    assert pool.describe(s).in_l3 is False


@pytest.mark.parametrize("field", ["key", "ns", "seal", "length", "key_len", "extent"])
def test_a_stray_write_to_a_ready_row_drops_it(pool_file: PoolFile, field: str) -> None:
    pool, _ = pool_file.start()
    (s,) = store(pool, pool_file.arena(), [k("r0")])
    del pool
    meta = pool_file.meta()
    if field == "key":
        meta.key[s * KEY_BYTES] ^= 1
    elif field == "key_len":
        meta.key_len[s] = KEY_BYTES + 1
    elif field == "extent":
        meta.ext_bytes[0] = 5000
    else:
        getattr(meta, field)[s] ^= 1
    meta.release()
    pool, res = pool_file.start(verify=False)
    assert (res.pages_adopted, res.pages_dropped) == (0, 1)
    assert pool.lookup(NS, [k("r0")]) == 0 and pool.describe(s).state is PageState.FREE


def test_duplicate_keys_and_parent_cycles_from_corruption_are_resolved(
    pool_file: PoolFile,
) -> None:
    pool, _ = pool_file.start()
    arena = pool_file.arena()
    a = store(pool, arena, chain("a", 2))
    (x,) = store(pool, arena, [k("x")])
    (y,) = store(pool, arena, [k("y")])
    del pool
    meta = pool_file.meta()
    meta.put_key(x, k("a1"))  # x claims a1's key, sealed, and is more recent
    meta.seal[x] = seal_of(k("a1"), NS, meta.checksum[x])
    meta.stamp[x] = 1000
    meta.parent[a[0]], meta.parent[y] = y, a[0]  # a0 <-> y: a cycle
    meta.parent[x] = x  # its own parent
    meta.release()
    pool, res = pool_file.start(verify=False)
    assert (res.pages_adopted, res.pages_dropped) == (3, 1)
    assert pool.lookup(NS, [k("a1")]) == 1 and pool.describe(x).key == k("a1")
    assert pool.describe(a[1]).state is PageState.FREE  # the older duplicate
    assert [pool.describe(t).parent for t in (a[0], x, y)] == [NIL, NIL, NIL]
    assert [pool.describe(t).children for t in (a[0], x, y)] == [0, 0, 0]
    assert sorted(pool.evictable_slots()) == sorted([a[0], x, y])


# ----------------------------------------------------- random op sequences


class RestartMachine(PoolMachine):
    """PoolMachine over persistent metadata, with payloads and checksums, plus a rule
    that crashes and adopts: READY pages must come back exactly, the rest is dropped,
    and every invariant of PoolMachine must hold on the adopted pool."""

    def make_pool(self) -> HostPool:
        self.layout = PoolLayout.plan(3 * EXTENT + 1000, EXTENT, 4 * KIB)
        self.file = mmap.mmap(-1, self.layout.file_bytes)
        self.view = memoryview(self.file)
        self.arena = self.view[self.layout.arena_offset :]
        self.filled = 0
        pool = new_pool(self.layout, meta=self.view[: self.layout.meta_bytes])
        assert pool.adopted is not None and not pool.adopted.adopted
        return pool

    def commit(self, slots: list[int]) -> None:
        sums = []
        for s in slots:
            d = self.pool.describe(s)
            nbytes = CLASS_BYTES[self.cls.index(d.class_id)]
            self.filled += 1
            data = (d.key or b"") + struct.pack("<Q", self.filled)
            self.arena[d.offset : d.offset + nbytes] = (data * (nbytes // len(data) + 1))[:nbytes]
            sums.append(page_checksum(self.arena[d.offset : d.offset + nbytes]))
        self.pool.commit(slots, sums)

    @rule()
    def commit_all(self) -> None:
        """Commit every WRITING page (more READY pages for restarts to adopt) but the
        detached ones (a cancelled STORE's: aborted, never committed)."""
        writing = sorted(set(self.live) - self.ready - self.detached)
        self.commit(writing)
        self.ready.update(writing)

    @precondition(lambda self: self.ready)  # something to adopt
    @rule(verify=st.booleans())
    def restart(self, verify: bool) -> None:
        old = self.pool
        before = {
            s: (old.describe(s), old.stats().classes[old.describe(s).class_id].page_bytes)
            for s in self.ready
        }
        writing = sorted(set(self.live) - self.ready)
        probes = [
            (ns, [k(f"c{c}.{i}") for i in range(start, start + 5)])
            for ns in (NS, NS2)
            for c in range(4)
            for start in range(5)
        ]
        lookups = [old.lookup(ns, keys) for ns, keys in probes]
        arena = self.arena if verify else None
        self.pool, res = opened(self.layout, self.view[: self.layout.meta_bytes], arena=arena)
        del old  # crashed: never touched again
        assert res.adopted and (res.pages_adopted, res.pages_dropped) == (len(before), len(writing))
        self.cls = [self.pool.register_class(b) for b in CLASS_BYTES]
        self.pins = {}
        for s in writing:
            self._forget(s, aborted=True)  # as if aborted: pages extending them are orphans
        for s, (d, page_bytes) in before.items():
            now = self.pool.describe(s)
            assert (now.key, now.ns_id, now.owner, now.offset, now.in_l3, now.last_access) == (
                d.key,
                d.ns_id,
                d.owner,
                d.offset,
                False,  # adoption clears every in-L3 mark: the store may have changed
                d.last_access,
            )
            assert self.pool.stats().classes[now.class_id].page_bytes == page_bytes
            assert self.pool.lookup(d.ns_id, [d.key]) == 1 and now.pins == 0
        assert [self.pool.lookup(ns, keys) for ns, keys in probes] == lookups
        stamps = [self.pool.describe(s).last_access for s in self.pool.evictable_slots()]
        assert stamps == sorted(stamps)  # LRU by last access, cold end first


TestRestartMachine = RestartMachine.TestCase
TestRestartMachine.settings = MACHINE_SETTINGS  # bounded: a failing run ends within the timeout


# ------------------------------------------------------------------ timing


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A temp dir in shared memory (/dev/shm, where the daemon keeps its pool)."""
    base = Path("/dev/shm")
    d = Path(tempfile.mkdtemp(prefix="kvt-persist-", dir=base if base.is_dir() else None))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_adopting_1gib_of_ready_pages_timing(shm_dir: Path) -> None:
    """4096 READY pages of 256 KiB (1 GiB), each verified by xxh3 at adoption. Prints
    the time to map the file again and to adopt; asserts only what was adopted."""
    if shutil.disk_usage(shm_dir).free < (3 << 30):
        pytest.skip("needs 3 GiB free for a 1 GiB pool file")
    page = 256 * KIB
    lay = PoolLayout.plan(1 << 30, 32 << 20)  # the daemon's default geometry
    seg, why = map_pool_file(shm_dir / "pool", lay, prefault=True)
    assert why is not None
    pool = new_pool(lay, meta=seg.view[: lay.meta_bytes])
    arena = seg.view[lay.arena_offset :]
    cls = pool.register_class(page)
    t0 = time.perf_counter()
    for c in range(64):
        keys = [struct.pack("<QQ", c, i) * 2 for i in range(64)]
        slots = [s for _, s in pool.allocate(1, 1, cls, keys)]
        for s, key in zip(slots, keys):
            arena[pool.slot_offset(s) : pool.slot_offset(s) + 32] = key
        pool.commit(slots, page_checksums(arena, [pool.slot_offset(s) for s in slots], page))
    t_store = time.perf_counter() - t0
    assert pool.stats().pages_ready == 4096
    del pool, arena  # the crash: the process's mapping and its lock on the file go
    seg.close(unlink=False)
    t0 = time.perf_counter()
    seg2, why = map_pool_file(shm_dir / "pool", lay, prefault=True)
    t_map = time.perf_counter() - t0
    assert why is None
    pool, res = opened(lay, seg2.view[: lay.meta_bytes], arena=seg2.view[lay.arena_offset :])
    assert (res.adopted, res.pages_adopted, res.bytes_adopted) == (True, 4096, 1 << 30)
    pool.close()
    pool, res2 = opened(lay, seg2.view[: lay.meta_bytes])
    print(
        f"\n1 GiB, 4096 x 256 KiB READY pages: fill+checksum {t_store:.3f} s; "
        f"remap (MAP_POPULATE) {t_map:.3f} s; adopt verified {res.seconds:.3f} s; "
        f"adopt unverified {res2.seconds:.3f} s; metadata {lay.meta_bytes >> 20} MiB"
    )
    pool.close()
    seg.close()
    seg2.close()


def test_a_full_namespace_table_gives_an_idle_namespaces_id_to_a_new_one() -> None:
    """With every namespace id taken, a new fingerprint gets the lowest id that holds no
    page (in any state) and is not in use by an open session; the old fingerprint is
    forgotten. A table whose namespaces all hold pages or are in use stays full."""
    lay = PoolLayout.plan(EXTENT, EXTENT, 4 * KIB)
    pool = new_pool(lay)
    cap = lay.id_capacity
    fps = [i.to_bytes(32, "little") for i in range(1, cap + 1)]
    assert [pool.namespace_id(fp) for fp in fps] == list(range(1, cap + 1))
    cls = pool.register_class(SMALL)
    assert len(pool.allocate(1, A, cls, chain("w", 1))) == 1  # a WRITING page in ns 1
    pool.commit([s for _, s in pool.allocate(2, A, cls, chain("r", 1))], [0])  # READY in ns 2
    new = b"\xff" * 32
    assert pool.namespace_id(new, in_use=[3]) == 4  # 1, 2 hold pages, 3 is in use
    assert new in pool.namespaces() and fps[3] not in pool.namespaces()
    assert pool.namespace_id(new) == 4 and pool.lookup(2, chain("r", 1)) == 1
    busy = [n for n in range(1, cap + 1) if n not in (1, 2)]
    with pytest.raises(HostPoolError, match="holds pages or has an open session"):
        pool.namespace_id(b"\xfe" * 32, in_use=busy)


def test_a_full_namespace_table_takes_the_coldest_cached_namespace_for_a_new_one() -> None:
    """With every namespace id holding pages and a ``reclaim`` given, a new fingerprint gets
    the id of the namespace, not in use, whose pages are all READY and unpinned and whose
    newest page was used the longest ago: its pages are dropped (children first) and told
    to ``reclaim`` before the id changes hands. A namespace with a page being written or
    pinned, or in use, keeps its pages; with none left to take, the table stays full."""
    lay = PoolLayout.plan(8 * EXTENT, EXTENT, 4 * KIB)
    pool = new_pool(lay)
    cap = lay.id_capacity
    fps = [i.to_bytes(32, "little") for i in range(1, cap + 1)]
    assert [pool.namespace_id(fp) for fp in fps] == list(range(1, cap + 1))
    cls = pool.register_class(SMALL)
    assert len(pool.allocate(1, A, cls, chain("w", 1))) == 1  # WRITING in ns 1
    for ns in (3, 2, 4, 5):  # ns 3 the coldest, then 2, 4, 5
        pool.commit([s for _, s in pool.allocate(ns, A, cls, chain(f"n{ns}-", 2))], [0, 0])
    pool.unpin(pool.pin(2, chain("n2-", 2), used=True))  # ns 2 used again: the newest
    assert pool.pin(4, chain("n4-", 1))  # ns 4 pinned
    told: list[dict[int, list[bytes]]] = []
    busy = list(range(6, cap + 1))
    assert pool.namespace_id(b"\xff" * 32, in_use=busy, reclaim=told.append) == 3
    assert told == [{3: [k("n3-1"), k("n3-0")]}]
    assert fps[2] not in pool.namespaces() and pool.lookup(3, chain("n3-", 2)) == 0
    assert pool.namespace_id(b"\xfe" * 32, in_use=[3, *busy], reclaim=told.append) == 5
    assert told[1] == {5: [k("n5-1"), k("n5-0")]}
    assert pool.lookup(2, chain("n2-", 2)) == 2 and pool.lookup(4, chain("n4-", 2)) == 2
    assert pool.namespace_id(b"\xfd" * 32, in_use=[3, 5, *busy], reclaim=told.append) == 2
    with pytest.raises(HostPoolError, match="holds pages or has an open session"):
        pool.namespace_id(b"\xfc" * 32, in_use=[2, 3, 5, *busy], reclaim=told.append)
    assert len(told) == 3 and pool.lookup(4, chain("n4-", 2)) == 2  # pinned: kept


def test_a_full_class_table_takes_the_coldest_cached_class_for_a_new_page_size() -> None:
    """Past ``max_classes`` with no idle class and a ``reclaim`` given, a new page size
    takes the id of the class, not in use, whose pages are all READY and unpinned and whose
    newest page was used the longest ago: its pages are dropped, its extents freed, and
    what was dropped is told per namespace first."""
    lay = PoolLayout.plan(8 * EXTENT, EXTENT, 4 * KIB)
    pool = new_pool(lay)
    small, big = pool.register_class(SMALL), pool.register_class(5000)
    pool.commit([s for _, s in pool.allocate(1, A, small, chain("s", 2))], [0, 0])
    pool.commit([s for _, s in pool.allocate(2, A, big, chain("b", 1))], [0])
    told: list[dict[int, list[bytes]]] = []
    with pytest.raises(HostPoolError, match="past the 2"):
        pool.register_class(6000, 2, in_use=[])
    assert pool.register_class(6000, 2, in_use=[], reclaim=told.append) == small
    assert told == [{1: [k("s1"), k("s0")]}]
    assert pool.lookup(1, chain("s", 2)) == 0 and pool.lookup(2, chain("b", 1)) == 1
    assert pool.register_class(6000, 2) == small and pool.register_class(5000, 2) == big
    slots = [s for _, s in pool.allocate(3, A, small, chain("x", 2))]
    pool.commit(slots, [0, 0])
    assert pool.lookup(3, chain("x", 2)) == 2
    with pytest.raises(HostPoolError, match="past the 2"):  # both in use now
        pool.register_class(7000, 2, in_use=[small, big], reclaim=told.append)
