"""Exact tests of slot headroom in the host pool (no mocks).

A pool built with ``headroom=H`` gives every slot ``H`` bytes right before its payload
(where an L3 backend writes a page's object header, so header and payload move as one
buffer). Extents are spaced ``span = extent_bytes + per_extent * H`` apart, a class of
``page_bytes`` pages has a stride of ``H + round_up(page_bytes, align)`` and still cuts
``min(extent_bytes // round_up(page_bytes, align), per_extent)`` slots per extent, and
``slot_offset`` is the payload's offset.

Geometry used throughout, the daemon's with small extents: align 128, headroom 128,
extents of 32 KiB payload sized for 4 KiB pages, so every extent reserves 8 slot ids and
spans 32 KiB + 8 x 128 B = 33792 B. Expected values are computed here from those
numbers, not taken from the layout, so a wrong layout shows.
"""

from __future__ import annotations

import struct
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from kvtier.config import DaemonConfig
from kvtier.daemon.pool.host_pool import AdoptResult, HostPool, HostPoolError, PageState
from kvtier.daemon.pool.layout import (
    FORMAT_VERSION,
    HEADROOM_ALIGN,
    HEADROOM_MIN_PAGE_BYTES,
    SLOT_HEADROOM,
    PoolLayout,
    map_pool_file,
    page_checksums,
)
from kvtier.daemon.storage.registry import slot_headroom
from kvtier.ipc.shm import SharedMemorySegment

from tests.xxh3_reference import xxh3_64

KIB = 1024
H = 128
ALIGN = 128
MIN_PAGE = 4 * KIB
EXTENT = 32 * KIB
PER = EXTENT // MIN_PAGE  # 8 slot ids per extent
SPAN = EXTENT + PER * H  # 33792
NS = 1
A = 10
OBJ_HEADER = 96  # what a Mooncake object header takes of the headroom


def k(name: str) -> bytes:
    return name.encode()


def chain(prefix: str, n: int) -> list[bytes]:
    return [k(f"{prefix}{i}") for i in range(n)]


def up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align`` (computed here, not by the pool)."""
    return -(-n // align) * align


def headroom_pool(capacity: int, **kw: Any) -> HostPool:
    """A pool of the module's geometry with headroom (the daemon's for Mooncake)."""
    return HostPool(capacity, EXTENT, ALIGN, min_page_bytes=MIN_PAGE, headroom=H, **kw)


def plain_pool(capacity: int) -> HostPool:
    """The same geometry without headroom."""
    return HostPool(capacity, EXTENT, ALIGN, min_page_bytes=MIN_PAGE)


def fill(pool: HostPool, cid: int, prefix: str) -> list[int]:
    """Allocate pages of ``cid`` until the pool refuses, commit them, and check that one
    more page takes an eviction (the pool is full). Return the slots of the fill."""
    want = pool.n_slots + 1
    slots = [s for _, s in pool.allocate(NS, A, cid, chain(prefix, want))]
    assert 0 < len(slots) < want  # WRITING pages are never evicted: it refused
    pool.commit(slots)
    assert pool.drain_evicted() == []
    more = pool.allocate(NS, A, cid, [k(prefix + "-more")])
    assert len(more) == 1 and len(pool.drain_evicted()) == 1  # full: it had to evict
    return slots


def live_ranges(pool: HostPool) -> list[tuple[int, int, int]]:
    """Check every non-FREE slot's payload offset against the headroom geometry and
    return ``(start of headroom, end of payload, slot)`` of each, sorted."""
    lay = pool.layout
    h, align, per = lay.headroom, lay.align, lay.per_extent
    span = lay.extent_bytes + per * h
    assert lay.span == span
    assert lay.n_extents == lay.capacity_bytes // span
    assert lay.n_extents * span <= lay.capacity_bytes
    page_bytes = [c.page_bytes for c in pool.stats().classes]
    out = []
    for s in range(pool.n_slots):
        d = pool.describe(s)
        if d.state is PageState.FREE:
            continue
        pb, off = page_bytes[d.class_id], d.offset
        e, i = divmod(s, per)
        assert off == pool.slot_offset(s)
        assert off % align == 0 and off >= h, (s, off)
        assert off == e * span + i * (h + up(pb, align)) + h, (s, off)
        assert e * span <= off - h and off + pb <= (e + 1) * span, (s, off, pb)
        out.append((off - h, off + pb, s))
    out.sort()
    return out


# ----------------------------------------------------------------- geometry


@pytest.mark.parametrize(
    "page_bytes",
    [100, 3000, 4096, 5000, 8 * KIB, EXTENT // 2 - 1, EXTENT // 2, EXTENT // 2 + 1, EXTENT],
)
def test_headroom_cuts_as_many_slots_per_extent_as_without(page_bytes: int) -> None:
    """For small, odd, exactly dividing and just-under/over-dividing page sizes, a pool
    with headroom cuts ``min(extent // round_up(page, align), per_extent)`` slots per
    extent, as the same geometry without headroom does; filled until it refuses and
    evicts, both hold that many pages in every extent, in the same slot ids."""
    n_ext = 3
    want = min(EXTENT // up(page_bytes, ALIGN), PER)
    with_h = headroom_pool(n_ext * SPAN + 1000)  # the 1000 B are unused
    without = plain_pool(n_ext * EXTENT)
    assert (with_h.n_extents, without.n_extents) == (n_ext, n_ext)
    assert with_h.n_slots == without.n_slots == n_ext * PER
    got = {}
    for name, pool in (("headroom", with_h), ("plain", without)):
        cid = pool.register_class(page_bytes)
        cls = pool.stats().classes[cid]
        assert cls.slots_per_extent == want, name
        got[name] = fill(pool, cid, name)
        assert Counter(s // PER for s in got[name]) == {e: want for e in range(n_ext)}, name
    assert with_h.class_stride(0) == H + up(page_bytes, ALIGN)
    assert without.class_stride(0) == up(page_bytes, ALIGN)
    assert sorted(got["headroom"]) == sorted(got["plain"])


def test_the_arena_holds_only_whole_spans() -> None:
    """Extents are counted by span, not by extent size: one byte short of three spans
    holds two extents, and an arena of one extent's payload but not its span holds none."""
    assert headroom_pool(3 * SPAN).n_extents == 3
    assert headroom_pool(3 * SPAN - 1).n_extents == 2
    assert plain_pool(3 * SPAN - 1).n_extents == 3  # without headroom it would be three
    with pytest.raises(HostPoolError, match="holds no"):
        headroom_pool(SPAN - 1)


MIXED = (100, 3000, 4096, 5000, EXTENT // 2 - 1, EXTENT)


@pytest.mark.parametrize(
    ("align", "headroom", "min_page"),
    [(128, 128, 4096), (128, 256, 4096), (64, 128, None), (256, 256, 1000), (4096, 4096, None)],
)
def test_payloads_are_aligned_and_slots_with_their_headroom_never_overlap(
    align: int, headroom: int, min_page: int | None
) -> None:
    """With pages of mixed classes, allocated, aborted, committed and evicted so that
    extents change class: every payload offset is a multiple of align and at least the
    headroom, the formula ``e * span + i * stride + H``, and the ranges
    ``[offset - H, offset + page_bytes)`` of all live slots are pairwise disjoint and lie
    inside their extent's span, which lies inside the arena."""
    n_ext = len(MIXED)
    per = EXTENT // up(min_page or align, align)
    span = EXTENT + per * headroom
    pool = HostPool(n_ext * span + 500, EXTENT, align, min_page_bytes=min_page, headroom=headroom)
    assert (pool.n_extents, pool.layout.per_extent, pool.layout.span) == (n_ext, per, span)
    cids = [pool.register_class(pb) for pb in MIXED]
    first = {cid: [s for _, s in pool.allocate(NS, A, cid, chain(f"c{cid}-", 2))] for cid in cids}
    assert all(first.values())
    assert len(live_ranges(pool)) == sum(map(len, first.values()))
    pool.abort(first[cids[0]])  # frees class 0's extent for another class
    pool.commit(first[cids[1]] + first[cids[2]] + first[cids[3]])  # evictable
    # classes 4 and 5 stay WRITING: never evicted, so the mix survives
    big = [s for _, s in pool.allocate(NS, A, cids[3], chain("big-", pool.n_slots))]
    assert {s // per for s in big} == {s // per for c in cids[:4] for s in first[c]}
    live_ranges(pool)  # class 3 took the extents of classes 0 to 3
    pool.commit(big)
    tiny = [s for _, s in pool.allocate(NS, A, cids[0], chain("tiny-", 3 * per))]
    assert tiny and pool.stats().evictions > 0  # evicted class 3 pages for an extent
    pool.abort(tiny[1::2])  # holes on class 0's free list
    assert {MIXED[pool.describe(s).class_id] for _, _, s in live_ranges(pool)} >= {
        MIXED[0],
        MIXED[4],
        MIXED[5],
    }
    tiny2 = [s for _, s in pool.allocate(NS, A, cids[0], chain("tiny2-", 2))]
    assert set(tiny2) <= set(tiny[1::2])  # the holes were reused
    pool.commit(tiny[::2] + tiny2)
    assert pool.allocate(NS, A, cids[1], chain("odd-", per))  # evicts for an extent again
    ranges = live_ranges(pool)
    sizes = {MIXED[pool.describe(s).class_id] for _, _, s in ranges}
    assert {MIXED[1], MIXED[4], MIXED[5]} <= sizes, sizes
    for (_, end, s), (start, _, t) in pairwise(ranges):
        assert end <= start, f"slots {s} and {t} overlap"
    assert ranges[-1][1] <= n_ext * span <= pool.layout.capacity_bytes


def test_headroom_bytes_and_payloads_written_through_every_slot_stay_apart() -> None:
    """Writing a 96-byte object header into each live slot's headroom and a payload at
    its offset, in an arena of the pool's capacity, leaves every header and payload as
    written (what an L3 backend and the copy threads do at once)."""
    pool = headroom_pool(4 * SPAN)
    cids = [pool.register_class(pb) for pb in (5000, 4096, EXTENT)]
    slots = []
    for j, cid in enumerate(cids):
        got = pool.allocate(NS, A, cid, chain(f"w{j}-", PER))
        slots += [(s, pool.stats().classes[cid].page_bytes) for _, s in got]
    arena = bytearray(pool.layout.capacity_bytes)
    for n, (s, pb) in enumerate(slots):
        off = pool.slot_offset(s)
        arena[off - H : off - H + OBJ_HEADER] = bytes([n % 251 + 1]) * OBJ_HEADER
        arena[off : off + pb] = bytes([n % 251 + 2]) * pb
    for n, (s, pb) in enumerate(slots):
        off = pool.slot_offset(s)
        assert arena[off - H : off - H + OBJ_HEADER] == bytes([n % 251 + 1]) * OBJ_HEADER, s
        assert arena[off : off + pb] == bytes([n % 251 + 2]) * pb, s


@pytest.mark.parametrize(
    ("align", "headroom"),
    [(128, 64), (128, 100), (128, 130), (128, 192), (128, -128), (64, 64), (256, 128), (4096, 128)],
)
def test_bad_headroom_is_refused(align: int, headroom: int) -> None:
    """A headroom that is not a multiple of align, or under SLOT_HEADROOM, or negative, is
    refused by the layout and by the pool, naming the headroom."""
    with pytest.raises(HostPoolError, match="headroom"):
        PoolLayout.plan(4 * EXTENT, EXTENT, align, headroom=headroom)
    with pytest.raises(HostPoolError, match="headroom"):
        HostPool(4 * EXTENT, EXTENT, align, headroom=headroom)


@pytest.mark.parametrize(
    ("align", "headroom"), [(128, 0), (128, 128), (128, 384), (64, 192), (4096, 0), (4096, 4096)]
)
def test_good_headroom_is_accepted(align: int, headroom: int) -> None:
    """0 (none) and any multiple of align of at least SLOT_HEADROOM are accepted, and the
    layout records it."""
    assert SLOT_HEADROOM == 128
    pool = HostPool(8 * EXTENT, EXTENT, align, headroom=headroom)
    assert pool.layout.headroom == headroom
    assert pool.layout.span == EXTENT + (EXTENT // align) * headroom


# ------------------------------------------------------------------ persistence


def layout(headroom: int = H) -> PoolLayout:
    """The pool file's layout: three spans of the module's geometry."""
    return PoolLayout.plan(3 * SPAN, EXTENT, ALIGN, MIN_PAGE, headroom=headroom)


class Started:
    """One start of a daemon over the pool file: the mapped file, the pool adopted over
    it and the adoption's result (``arena`` is the arena part of the mapping)."""

    def __init__(
        self, path: Path, lay: PoolLayout, *, verify: bool = True, arena_bytes: int | None = None
    ) -> None:
        self.seg, why = map_pool_file(path, lay, prefault=False)
        view = self.seg.view
        self.arena = view[lay.arena_offset : lay.arena_offset + lay.capacity_bytes]
        arena = self.arena[: arena_bytes or lay.capacity_bytes] if verify else None
        try:
            self.pool = HostPool(
                lay.capacity_bytes,
                lay.extent_bytes,
                lay.align,
                min_page_bytes=MIN_PAGE,
                headroom=lay.headroom,
                meta=view[: lay.meta_bytes],
                arena=arena,
                cold_start=why or False,
            )
        except BaseException:  # a refused start ends its process: its lock on the file goes
            self.arena.release()
            self.seg.close()
            raise
        assert self.pool.adopted is not None
        self.res: AdoptResult = self.pool.adopted

    def stop(self) -> None:
        """A planned stop: close the pool and the mapping, keep the file."""
        self.pool.close()
        self.arena.release()
        self.seg.close()


def store(run: Started, page_bytes: int, keys: list[bytes]) -> dict[bytes, tuple[int, int]]:
    """Store ``keys`` as pages of ``page_bytes``: an object header into each headroom,
    the payload at the slot offset, commit with the checksums the daemon records
    (:func:`page_checksums` of the bytes at the slot offsets). Return key -> (slot, offset)."""
    pool, arena = run.pool, run.arena
    got = pool.allocate(NS, A, pool.register_class(page_bytes), keys)
    assert len(got) == len(keys)
    out = {}
    for i, s in got:
        off = pool.slot_offset(s)
        arena[off - H : off - H + OBJ_HEADER] = b"H" * OBJ_HEADER
        arena[off : off + page_bytes] = payload(keys[i], page_bytes)
        out[keys[i]] = (s, off)
    offsets = [off for _, off in out.values()]
    pool.commit([s for _, s in got], page_checksums(arena, offsets, page_bytes))
    return out


def payload(key: bytes, nbytes: int) -> bytes:
    """Page bytes that name their key, so a mix-up shows."""
    return (key * (nbytes // len(key) + 1))[:nbytes]


@pytest.fixture
def pool_path(tmp_path: Path) -> Path:
    return tmp_path / "kvtier-pool-h"


def test_a_restarted_pool_adopts_pages_at_the_same_payload_offsets(pool_path: Path) -> None:
    """Pages of two classes over two extents, stored with an object header in each
    headroom, are adopted with verified checksums by a restarted pool at the very same
    slots and payload offsets; a payload byte flipped drops that page only, a headroom
    byte flipped drops nothing (the headroom is not the page's bytes)."""
    run = Started(pool_path, layout())
    assert run.res.adopted is False and run.res.reason == "no pool file (first start)"
    assert run.pool.layout.headroom == H
    pages = {
        5000: store(run, 5000, chain("a", 8)),  # 6 per extent: two extents
        4096: store(run, 4096, chain("b", 3)),
    }
    extents = {s // PER for got in pages.values() for s, _ in got.values()}
    assert extents == {0, 1, 2}
    assert all(off % ALIGN == 0 and off >= H for got in pages.values() for _, off in got.values())
    _, bad_off = pages[5000][k("a3")]
    _, hdr_off = pages[5000][k("a7")]
    run.arena[bad_off + 4999] ^= 0xFF  # the last payload byte
    run.arena[hdr_off - 1] ^= 0xFF  # the last headroom byte
    run.stop()

    run = Started(pool_path, layout())
    assert (run.res.adopted, run.res.pages_adopted, run.res.pages_dropped) == (True, 10, 1)
    assert run.res.bytes_adopted == 7 * 5000 + 3 * 4096
    pool = run.pool
    for page_bytes, got in pages.items():
        for key, (slot, off) in got.items():
            d = pool.describe(slot)
            if key == k("a3"):
                assert d.state is PageState.FREE
                continue
            assert (d.state, d.key, d.offset) == (PageState.READY, key, off), key
            assert pool.slot_offset(slot) == off
            assert bytes(run.arena[off : off + page_bytes]) == payload(key, page_bytes)
            # a known answer: XXH3-64 of the payload by the tests' own implementation
            assert d.checksum == xxh3_64(payload(key, page_bytes))
    assert pool.lookup(NS, chain("a", 8)) == 3 and pool.lookup(NS, chain("b", 3)) == 3
    run.stop()


def test_an_arena_without_the_headroom_slack_is_refused(pool_path: Path) -> None:
    """Verifying adoption needs ``n_extents * span`` bytes of arena: one of only
    ``n_extents * extent_bytes`` is refused, not read out of range."""
    run = Started(pool_path, layout())
    store(run, 5000, chain("a", 2))
    run.stop()
    with pytest.raises(HostPoolError, match="the arena has"):
        Started(pool_path, layout(), arena_bytes=3 * EXTENT)
    run = Started(pool_path, layout(), arena_bytes=3 * SPAN)
    assert (run.res.adopted, run.res.pages_adopted) == (True, 2)
    run.stop()


def test_a_different_headroom_discards_the_pool(pool_path: Path) -> None:
    """A pool planned without headroom over a file written with 128 bytes of it (same
    file size, extents and slots) discards everything, the reason naming the headroom;
    and the other way round."""
    with_h, without = layout(H), layout(0)
    assert without.file_bytes == with_h.file_bytes  # map_pool_file keeps the file
    assert (without.n_extents, without.n_slots) == (with_h.n_extents, with_h.n_slots)
    run = Started(pool_path, with_h)
    store(run, 5000, chain("a", 4))
    run.stop()

    run = Started(pool_path, without)
    assert (run.res.adopted, run.res.pages_adopted) == (False, 0)
    assert run.res.reason == f"geometry changed: headroom {H} -> 0"
    assert run.pool.lookup(NS, chain("a", 4)) == 0
    store(run, 5000, chain("b", 2))
    run.stop()

    run = Started(pool_path, with_h)
    assert (run.res.adopted, run.res.pages_adopted) == (False, 0)
    assert run.res.reason == f"geometry changed: headroom 0 -> {H}"
    run.stop()


def test_a_version_1_header_is_discarded(pool_path: Path) -> None:
    """A header of format version 1 (the version field patched, nothing recomputed) is
    discarded with a reason naming the version, though its geometry is ours."""
    assert FORMAT_VERSION == 2
    run = Started(pool_path, layout())
    store(run, 5000, chain("a", 3))
    run.stop()
    seg = SharedMemorySegment.open(pool_path)
    struct.pack_into("<I", seg.view, 8, 1)  # after the 8-byte magic
    seg.close()

    run = Started(pool_path, layout())
    assert (run.res.adopted, run.res.pages_adopted) == (False, 0)
    assert run.res.reason == f"metadata format version 1, this build reads {FORMAT_VERSION}"
    assert run.pool.lookup(NS, chain("a", 3)) == 0
    run.stop()
    run = Started(pool_path, layout())  # the discard wrote a version 2 header
    assert (run.res.adopted, run.res.generation) == (True, 2)
    run.stop()


# ------------------------------------------------------------------ the daemon


@pytest.mark.parametrize(
    ("backend", "headroom"),
    [("mooncake", SLOT_HEADROOM), ("file", 0), ("redis", 0), ("none", 0), ("dynamic", 0)],
)
def test_slot_headroom_per_backend(backend: str, headroom: int) -> None:
    """Only Mooncake gets slot headroom."""
    assert slot_headroom(backend) == headroom


@pytest.mark.parametrize(
    ("backend", "headroom", "align", "n_extents"),
    [("mooncake", 128, 128, 3), ("file", 0, 4096, 4), ("none", 0, 4096, 4)],
)
def test_the_daemon_pool_has_headroom_for_mooncake_only(
    backend: str, headroom: int, align: int, n_extents: int
) -> None:
    """``HostPool.from_config`` builds a pool with 128 bytes of headroom and 128-byte alignment,
    slot ids sized for 4 KiB pages, for Mooncake, and the plain 4 KiB-aligned pool for
    the others; 1 MiB holds three 256 KiB extents with their headroom, four without."""

    assert (HEADROOM_ALIGN, HEADROOM_MIN_PAGE_BYTES) == (128, 4096)
    cfg = DaemonConfig(hicache_size=1 << 20, extent_size=256 * KIB, hicache_storage_backend=backend)
    pool = HostPool.from_config(cfg, slot_headroom(cfg.hicache_storage_backend))
    lay = pool.layout
    assert (lay.headroom, lay.align, lay.per_extent) == (headroom, align, 64)
    assert (lay.span, lay.n_extents) == (256 * KIB + 64 * headroom, n_extents)
    cid = pool.register_class(5000)
    slots = [s for _, s in pool.allocate(NS, A, cid, chain("p", 3))]
    offsets = [pool.slot_offset(s) for s in slots]
    stride = headroom + up(5000, align)
    assert offsets == [headroom + i * stride for i in range(3)]


def test_a_pool_too_small_for_one_extent_with_headroom_is_a_config_error() -> None:
    """``hicache_size == extent_size`` is a valid config, but with Mooncake's headroom
    the one extent no longer fits: the start fails with a ConfigError naming both
    fields and the bytes needed; the file backend's pool keeps working with it."""
    from kvtier.config.errors import ConfigError

    cfg = DaemonConfig(
        hicache_size=256 * KIB, extent_size=256 * KIB, hicache_storage_backend="mooncake"
    )
    with pytest.raises(
        ConfigError,
        match=r"hicache_size \(262144\).*extent_size \(262144\)"
        r".*270336 bytes",
    ):
        HostPool.from_config(cfg, slot_headroom(cfg.hicache_storage_backend))
    ok = DaemonConfig(
        hicache_size=256 * KIB + 64 * 128, extent_size=256 * KIB, hicache_storage_backend="mooncake"
    )
    assert HostPool.from_config(ok, slot_headroom(ok.hicache_storage_backend)).layout.n_extents == 1
    plain = DaemonConfig(
        hicache_size=256 * KIB, extent_size=256 * KIB, hicache_storage_backend="file"
    )
    assert (
        HostPool.from_config(plain, slot_headroom(plain.hicache_storage_backend)).layout.n_extents
        == 1
    )
