"""Guarded page copies: a SIGBUS inside one ends that copy, and only there.

An engine may truncate the memfd it handed over (SGLang's cannot be sealed). The daemon
maps such memory for :func:`kvtier.kernels.guarded_copy.copy_pages` only; these tests
show that a copy over a shrunken mapping stops and says how far it got, from any thread,
again and again, and that a SIGBUS anywhere else still ends the process as before.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from kvtier.kernels import guarded_copy

pytestmark = pytest.mark.skipif(
    not guarded_copy.available(), reason="kvtier.kernels._guarded was not built (no C compiler)"
)
PAGE = 64 << 10
N = 16


@pytest.fixture
def mapped():
    fd = os.memfd_create("kvtier-test-guarded")
    os.ftruncate(fd, N * PAGE)
    os.pwrite(fd, np.random.default_rng(1).integers(0, 256, N * PAGE, dtype=np.uint8).tobytes(), 0)
    mm = mmap.mmap(fd, N * PAGE)
    view = np.frombuffer(mm, dtype=np.uint8)
    yield fd, mm, view
    os.close(fd)  # the mapping goes with its last view


def addrs(base: int, pages: range) -> list[int]:
    return [base + p * PAGE for p in pages]


@pytest.mark.parametrize("stream", [False, True], ids=["memcpy", "stream"])
def test_pages_are_copied_both_ways(mapped, stream):
    _, mm, view = mapped
    out = np.zeros(N * PAGE, dtype=np.uint8)
    assert (
        guarded_copy.copy_pages(
            addrs(out.ctypes.data, range(N)),
            addrs(view.ctypes.data, range(N - 1, -1, -1)),
            PAGE,
            stream,
        )
        == N
    )
    assert out.tobytes() == b"".join(mm[p * PAGE : (p + 1) * PAGE] for p in range(N - 1, -1, -1))
    out[:] = 7
    assert (
        guarded_copy.copy_pages(
            addrs(view.ctypes.data, range(N)), addrs(out.ctypes.data, range(N)), PAGE, stream
        )
        == N
    )
    assert mm[:] == bytes([7]) * (N * PAGE)


@pytest.mark.parametrize(
    "length",
    [1, 31, 127, 128, 129, 1000, 4096 + 77]
    # blocks of 4 x 4 KiB, then of 2 x 4 KiB, then line groups: each path alone, the three
    # in turn, and the lengths around each step
    + [2 * 4096, 2 * 4096 + 129, 4 * 4096 - 1, 4 * 4096, 4 * 4096 + 4096 + 129]
    + [6 * 4096 + 100, 7 * 4096 + 4095, 65536, 65536 + 33, 11 * 4096 + 31],
)
def test_streamed_copies_are_exact_at_any_alignment_and_length(length):
    """Non-temporal stores need aligned destinations: the unaligned head, the blocks copied
    several at a time and the tail past the last whole vector are copied apart; every byte
    lands, none around it is touched."""
    rng = np.random.default_rng(length)
    src = rng.integers(0, 256, 64 + 8 * (length + 64), dtype=np.uint8)
    out = np.full(64 + 8 * (length + 64), 0xAB, dtype=np.uint8)
    shifts = [0, 1, 7, 15, 16, 17, 31, 33]  # the destination's offset past a 64-byte line
    base = -out.ctypes.data % 64
    dsts = [out.ctypes.data + base + i * (length + 64) + sh for i, sh in enumerate(shifts)]
    srcs = [src.ctypes.data + 3 + i * (length + 64) for i in range(len(shifts))]
    assert guarded_copy.copy_pages(dsts, srcs, length, True) == len(shifts)
    want = np.full_like(out, 0xAB)
    for d, s_ in zip(dsts, srcs):
        want[d - out.ctypes.data : d - out.ctypes.data + length] = src[
            s_ - src.ctypes.data : s_ - src.ctypes.data + length
        ]
    assert (out == want).all()


@pytest.mark.parametrize("length", [1, 100, 128, 2048, 4096 + 77, 65536])
def test_streamed_pages_copied_four_at_a_time_land_exactly(length):
    """Streamed pages go four at a time when all four destinations are 32-byte aligned (one
    line group of each in turn), else one by one: 9 pages make two groups and one alone,
    and a group with one unaligned destination goes page by page; every byte lands, none
    around it is touched."""
    rng = np.random.default_rng(length)
    gap = length + 96
    src = rng.integers(0, 256, 32 + 12 * gap, dtype=np.uint8)
    step = (gap + 31) // 32 * 32
    out = np.full(128 + 12 * step, 0xAB, dtype=np.uint8)
    base = out.ctypes.data + (-out.ctypes.data % 64)
    slots = list(rng.permutation(12)[:9])  # destinations in any order, 32-byte aligned
    for batch in ([0] * 9, [0, 0, 8, 0] + [0] * 5):  # then page 2's destination unaligned
        out[:] = 0xAB
        dsts = [base + int(k) * step + sh for k, sh in zip(slots, batch)]
        srcs = [src.ctypes.data + 5 + i * gap for i in range(9)]
        assert guarded_copy.copy_pages(dsts, srcs, length, True) == 9
        want = np.full_like(out, 0xAB)
        for d, s_ in zip(dsts, srcs):
            a, b = d - out.ctypes.data, s_ - src.ctypes.data
            want[a : a + length] = src[b : b + length]
        assert (out == want).all()


@pytest.mark.parametrize("stream", [False, True], ids=["memcpy", "stream"])
def test_a_shrunken_mapping_stops_the_copy_where_it_faults_from_any_thread(mapped, stream):
    fd, _, view = mapped
    out = np.zeros(N * PAGE, dtype=np.uint8)
    os.ftruncate(fd, 5 * PAGE)  # pages 5.. are gone: touching them is a SIGBUS
    order = [0, 1, 2, 9, 3]
    assert (
        guarded_copy.copy_pages(
            addrs(out.ctypes.data, range(5)),
            [view.ctypes.data + p * PAGE for p in order],
            PAGE,
            stream,
        )
        == 3
    )
    got: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: got.append(
                guarded_copy.copy_pages(
                    addrs(out.ctypes.data, range(N)),
                    addrs(view.ctypes.data, range(N)),
                    PAGE,
                    stream,
                )
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [5, 5, 5, 5]
    # writes fault the same way
    assert (
        guarded_copy.copy_pages(
            addrs(view.ctypes.data, range(4, 8)), addrs(out.ctypes.data, range(4)), PAGE, stream
        )
        == 1
    )


def test_a_sigbus_outside_a_guarded_copy_still_ends_the_process():
    code = (
        "import mmap, os\n"
        "from kvtier.kernels import guarded_copy\n"
        "if not guarded_copy.available(): raise SystemExit(3)\n"
        "fd = os.memfd_create('x'); os.ftruncate(fd, 1 << 16)\n"
        "mm = mmap.mmap(fd, 1 << 16); os.ftruncate(fd, 0)\n"
        "mm[100]\n"
        "print('survived')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)
    assert "survived" not in proc.stdout


def test_bad_arguments_are_refused_before_any_copy():
    with pytest.raises(ValueError, match="length"):
        guarded_copy.copy_pages([1], [2], 0)
    with pytest.raises(ValueError, match="1 dsts but 2 srcs"):
        guarded_copy.copy_pages([1], [2, 3], 8)
    with pytest.raises(TypeError):
        guarded_copy.copy_pages(5, [2], 8)


# -- copy_strided: one region of a transfer in one call -----------------------------------------

strided = pytest.mark.skipif(
    not guarded_copy.strided(), reason="kvtier.kernels._guarded was not built (no C compiler)"
)
ROW = 16 << 10  # one region's bytes per page: a quarter of a 64 KiB host page


def region(view: np.ndarray, pages: int) -> tuple[int, int, int]:
    """(page 0's address, pages, stride) of a region of ``pages`` pages of ``ROW`` bytes."""
    return view.ctypes.data, pages, ROW


@strided
@pytest.mark.parametrize("stream", [False, True], ids=["memcpy", "stream"])
def test_strided_copies_move_one_region_both_ways_exactly(mapped, stream):
    _, mm, view = mapped  # the engine: N * 4 pages of one 16 KiB region
    rng = np.random.default_rng(2)
    arena = rng.integers(0, 256, 8 * PAGE * N, dtype=np.uint8)
    offsets = np.array(rng.permutation(8 * N)[:N], dtype=np.int64) * PAGE  # scattered slots
    pids = np.array(rng.permutation(4 * N)[:N], dtype=np.int64)
    host_add = ROW * 2  # the third quarter of each slot
    before = arena.copy()
    base, pages, stride = region(view, 4 * N)
    assert (
        guarded_copy.copy_strided(
            arena.ctypes.data,
            arena.size,
            offsets,
            host_add,
            base,
            pages,
            pids,
            stride,
            ROW,
            True,
            stream,
        )
        == N
    )
    for o, p in zip(offsets.tolist(), pids.tolist()):
        assert arena[o + host_add : o + host_add + ROW].tobytes() == mm[p * ROW : (p + 1) * ROW]
    untouched = np.ones(arena.size, dtype=bool)
    for o in offsets.tolist():
        untouched[o + host_add : o + host_add + ROW] = False
    assert (arena[untouched] == before[untouched]).all()  # nothing else was written
    arena[:] = rng.integers(0, 256, arena.size, dtype=np.uint8)
    engine_before = np.frombuffer(mm, dtype=np.uint8).copy()
    assert (
        guarded_copy.copy_strided(
            arena.ctypes.data,
            arena.size,
            offsets,
            host_add,
            base,
            pages,
            pids,
            stride,
            ROW,
            False,
            stream,
        )
        == N
    )
    got = np.frombuffer(mm, dtype=np.uint8).reshape(4 * N, ROW)
    for o, p in zip(offsets.tolist(), pids.tolist()):
        assert got[p].tobytes() == arena[o + host_add : o + host_add + ROW].tobytes()
    others = np.setdiff1d(np.arange(4 * N), pids)
    assert (got[others] == engine_before.reshape(4 * N, ROW)[others]).all()


@strided
@pytest.mark.parametrize(
    ("pid", "offset", "match"),
    [
        (-1, 0, r"page_ids\[1\] = -1 is outside the region's 64 pages"),
        (64, 0, r"page_ids\[1\] = 64 is outside"),
        (1 << 62, 0, r"page_ids\[1\] = 4611686018427387904 is outside"),
        (3, -PAGE, r"offsets\[1\] = -65536"),
        (
            3,
            4 * PAGE - ROW,
            (
                r"offsets\[1\] = 245760 \+ 32768: 16384 bytes there are outside "
                r"the arena's 262144"
            ),
        ),
        (3, 1 << 62, r"offsets\[1\] = 4611686018427387904"),
    ],
)
def test_strided_copies_check_every_index_before_any_byte_moves(mapped, pid, offset, match):
    _, mm, view = mapped
    arena = np.zeros(4 * PAGE, dtype=np.uint8)
    before = bytes(mm[:])
    offsets = np.array([0, offset], dtype=np.int64)
    pids = np.array([0, pid], dtype=np.int64)
    for to_host in (True, False):
        with pytest.raises(ValueError, match=match):
            guarded_copy.copy_strided(
                arena.ctypes.data,
                arena.size,
                offsets,
                2 * ROW,
                view.ctypes.data,
                4 * N,
                pids,
                ROW,
                ROW,
                to_host,
            )
    assert not arena.any() and mm[:] == before  # the valid first page was not copied either


@strided
def test_strided_copies_refuse_bad_shapes():
    arena = np.zeros(PAGE, dtype=np.uint8)
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="one length"):
        guarded_copy.copy_strided(
            arena.ctypes.data,
            PAGE,
            one,
            0,
            arena.ctypes.data,
            1,
            np.zeros(2, dtype=np.int64),
            ROW,
            ROW,
            True,
        )
    with pytest.raises(ValueError, match="length = 0 must be > 0"):
        guarded_copy.copy_strided(
            arena.ctypes.data, PAGE, one, 0, arena.ctypes.data, 1, one, ROW, 0, True
        )
    with pytest.raises(ValueError, match="at most stride"):  # rows would overlap
        guarded_copy.copy_strided(
            arena.ctypes.data, PAGE, one, 0, arena.ctypes.data, 1, one, ROW, ROW + 1, True
        )
    for host_add in (-1, -(1 << 62), PAGE - ROW + 1, 1 << 62):  # no overflow past the checks
        with pytest.raises(ValueError, match=f"host_add = {host_add} must not be negative"):
            guarded_copy.copy_strided(
                arena.ctypes.data, PAGE, one, host_add, arena.ctypes.data, 1, one, ROW, ROW, True
            )
    # an empty region copies nothing
    none = np.zeros(0, dtype=np.int64)
    assert (
        guarded_copy.copy_strided(arena.ctypes.data, PAGE, none, 0, 0, 0, none, ROW, ROW, True) == 0
    )


@strided
def test_strided_copies_stop_at_a_shrunken_mapping_both_ways(mapped):
    fd, _, view = mapped
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    os.ftruncate(fd, 5 * ROW)  # region pages 5.. are gone
    offsets = np.arange(4, dtype=np.int64) * PAGE
    pids = np.array([0, 4, 7, 1], dtype=np.int64)
    for to_host in (True, False):
        assert (
            guarded_copy.copy_strided(
                arena.ctypes.data,
                arena.size,
                offsets,
                0,
                view.ctypes.data,
                4 * N,
                pids,
                ROW,
                ROW,
                to_host,
            )
            == 2
        )


# -- copy_regions: every region of a transfer in one call ---------------------------------------


def table_of(rows: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    """Rows (host_add, engine, engine_pages, stride, length) as copy_regions takes them."""
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


@strided
@pytest.mark.parametrize("stream", [False, True], ids=["memcpy", "stream"])
def test_region_tables_copy_each_row_as_a_strided_copy_would(mapped, stream):
    _, mm, view = mapped  # the engine: 4 regions of 16 pages of 16 KiB, one after the other
    rng = np.random.default_rng(3)
    offsets = np.array(rng.permutation(8 * N)[: N - 3], dtype=np.int64) * PAGE
    pids = np.array(rng.permutation(N)[: N - 3], dtype=np.int64)
    base = view.ctypes.data
    rows = [(i * ROW, base + ((3 * i) % 4) * N * ROW, N, ROW, ROW) for i in range(4)]
    for to_host in (True, False):
        start = rng.integers(0, 256, 8 * PAGE * N, dtype=np.uint8)
        engine_start = np.frombuffer(mm, dtype=np.uint8).copy()
        want = start.copy()
        for add, engine, pages, stride, length in rows:  # the reference: one call per row
            assert guarded_copy.copy_strided(
                want.ctypes.data,
                want.size,
                offsets,
                add,
                engine,
                pages,
                pids,
                stride,
                length,
                to_host,
            ) == len(pids)
        want_engine = np.frombuffer(mm, dtype=np.uint8).copy()
        mm[:] = engine_start.tobytes()
        got = start.copy()
        assert guarded_copy.copy_regions(
            got.ctypes.data, got.size, offsets, pids, table_of(rows), to_host, stream
        ) == 4 * len(pids)
        assert np.array_equal(got, want)
        assert np.array_equal(np.frombuffer(mm, dtype=np.uint8), want_engine)


@strided
@pytest.mark.parametrize("to_host", [True, False], ids=["store", "load"])
def test_a_region_table_that_faults_inside_a_group_counts_exactly(mapped, to_host):
    """Streamed pages go four at a time; a page that faults inside a group leaves the group
    partly copied, so it is copied again page by page: the count names the page that faulted
    (here row 1's fourth page), and every page before it is whole."""
    fd, mm, view = mapped
    offsets = np.arange(5, dtype=np.int64) * PAGE
    pids = np.arange(5, dtype=np.int64)
    base = view.ctypes.data
    # row 0: the first ROW bytes of engine pages 0..4; row 1: the next ROW bytes of pages 2..6
    rows = [(0, base, N, PAGE, ROW), (ROW, base + 2 * PAGE + ROW, N - 3, PAGE, ROW)]
    arena = np.random.default_rng(5).integers(0, 256, 8 * PAGE, dtype=np.uint8)
    host0, engine0 = arena.tobytes(), mm[: 5 * PAGE]
    os.ftruncate(fd, 5 * PAGE)  # row 1's fourth page is engine page 5: gone
    got = guarded_copy.copy_regions(
        arena.ctypes.data, arena.size, offsets, pids, table_of(rows), to_host, True
    )
    assert got == 5 + 3
    host, engine = arena.tobytes(), mm[: 5 * PAGE]  # (a repr of the mapping would fault)
    copied = [(0, p, p) for p in range(5)] + [(ROW, p, p + 2) for p in range(3)]
    for add, slot, page in copied:
        h, e = slot * PAGE + add, page * PAGE + add
        if to_host:
            assert host[h : h + ROW] == engine0[e : e + ROW], (add, slot)
        else:
            assert engine[e : e + ROW] == host0[h : h + ROW], (add, slot)
    if to_host:  # row 1's slot 3, whose page faulted, keeps what it held
        h = 3 * PAGE + ROW
        assert host[h : h + ROW] == host0[h : h + ROW]


@strided
@pytest.mark.parametrize(
    ("row", "match"),
    [
        ((0, 0, N, ROW, 0), r"table row 1: length = 0 must be > 0"),
        (
            (0, 0, N, ROW - 1, ROW),
            r"table row 1: length = 16384 must be > 0 and at most stride = 16383",
        ),
        ((0, 0, -1, ROW, ROW), r"engine_pages = -1 and host_add = 0 must not be negative"),
        ((-1, 0, N, ROW, ROW), r"host_add = -1 must not be negative"),
        (
            (PAGE * 4, 0, N, ROW, ROW),
            r"host_add = 262144 must not be negative, nor host_add \+ length over",
        ),
        ((1 << 62, 0, N, ROW, ROW), r"host_add = 4611686018427387904"),
        ((0, 0, N, ROW, 1 << 62), r"length = 4611686018427387904"),
    ],
)
def test_region_tables_refuse_a_bad_row_before_any_byte_moves(mapped, row, match):
    _, mm, view = mapped
    arena = np.zeros(4 * PAGE, dtype=np.uint8)
    before = bytes(mm[:])
    good = (0, view.ctypes.data, N, ROW, ROW)
    bad = tuple(v if i != 1 else view.ctypes.data for i, v in enumerate(row))
    one = np.zeros(1, dtype=np.int64)
    for to_host in (True, False):
        with pytest.raises(ValueError, match=match):
            guarded_copy.copy_regions(
                arena.ctypes.data, arena.size, one, one, table_of([good, bad]), to_host
            )
    assert not arena.any() and mm[:] == before  # the good first row was not copied either


@strided
@pytest.mark.parametrize(
    ("pid", "offset", "match"),
    [
        (-1, 0, r"page_ids\[1\] = -1 is outside the regions' 8 pages"),
        (8, 0, r"page_ids\[1\] = 8 is outside the regions' 8 pages"),  # the smaller row's count
        (3, -PAGE, r"offsets\[1\] = -65536"),
        (
            3,
            4 * PAGE - 2 * ROW,
            (
                r"offsets\[1\] = 229376: the 49152 bytes of a page there are "
                r"outside the arena's 262144"
            ),
        ),
        (3, 1 << 62, r"offsets\[1\] = 4611686018427387904"),
    ],
)
def test_region_tables_check_every_index_against_every_row(mapped, pid, offset, match):
    _, mm, view = mapped
    arena = np.zeros(4 * PAGE, dtype=np.uint8)
    before = bytes(mm[:])
    rows = [(0, view.ctypes.data, 4 * N, ROW, ROW), (2 * ROW, view.ctypes.data, 8, ROW, ROW)]
    offsets = np.array([0, offset], dtype=np.int64)
    pids = np.array([0, pid], dtype=np.int64)
    for to_host in (True, False):
        with pytest.raises(ValueError, match=match):
            guarded_copy.copy_regions(
                arena.ctypes.data, arena.size, offsets, pids, table_of(rows), to_host
            )
    assert not arena.any() and mm[:] == before


@strided
def test_region_tables_refuse_bad_shapes_and_copy_nothing_when_empty():
    arena = np.zeros(PAGE, dtype=np.uint8)
    one = np.zeros(1, dtype=np.int64)
    row = table_of([(0, arena.ctypes.data, 1, ROW, ROW)])
    with pytest.raises(ValueError, match="one length"):
        guarded_copy.copy_regions(
            arena.ctypes.data, PAGE, one, np.zeros(2, dtype=np.int64), row, True
        )
    with pytest.raises(ValueError, match="int64 rows of 5"):
        guarded_copy.copy_regions(arena.ctypes.data, PAGE, one, one, row.ravel()[:4].copy(), True)
    none = np.zeros(0, dtype=np.int64)
    assert guarded_copy.copy_regions(arena.ctypes.data, PAGE, none, none, row, True) == 0
    assert guarded_copy.copy_regions(arena.ctypes.data, PAGE, one, one, table_of([]), True) == 0


@strided
def test_region_tables_stop_at_a_shrunken_mapping_and_say_where(mapped):
    fd, _, view = mapped
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    base = view.ctypes.data
    os.ftruncate(fd, 2 * N * ROW + 5 * ROW)  # the second row's pages 5.. are gone
    rows = table_of([(0, base, N, ROW, ROW), (ROW, base + 2 * N * ROW, N, ROW, ROW)])
    offsets = np.arange(4, dtype=np.int64) * PAGE
    pids = np.array([0, 4, 7, 1], dtype=np.int64)
    for to_host in (True, False):  # row 1, page 2 (page id 7) faults: 4 + 2 pages copied
        assert (
            guarded_copy.copy_regions(arena.ctypes.data, arena.size, offsets, pids, rows, to_host)
            == 6
        )
