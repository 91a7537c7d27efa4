"""The native copy threads (:class:`~kvtier.daemon.transfer.copy_threads.CopyThreads`):
region copies run in C and end through the eventfd, exactly as the one-call copy would copy
them; layers are announced (and woken) as the completion block's own methods would; users
take turns across native and Python jobs; a cancelled, short or refused copy says so; a
shutdown drops what is queued."""

from __future__ import annotations

import mmap
import os
import select
import threading
import time

import numpy as np
import pytest
from kvtier.daemon.transfer import copy_threads as ct
from kvtier.daemon.transfer.copy_threads import CopyThreads
from kvtier.ipc.completion import LAYERS_DONE, SLOT_WORDS, WAKES, CompletionBlock
from kvtier.kernels import guarded_copy

pytestmark = pytest.mark.skipif(
    not CopyThreads.available(), reason="kvtier.kernels._guarded was not built (no C compiler)"
)
PAGE = 64 << 10
ROW = PAGE // 4
N = 16


@pytest.fixture
def engine():
    """An engine's memfd of 4 regions x 16 pages of 16 KiB, mapped, random bytes."""
    fd = os.memfd_create("kvtier-test-copy-threads")
    os.ftruncate(fd, N * PAGE)
    os.pwrite(fd, np.random.default_rng(1).integers(0, 256, N * PAGE, dtype=np.uint8).tobytes(), 0)
    mm = mmap.mmap(fd, N * PAGE)
    yield fd, mm, np.frombuffer(mm, dtype=np.uint8)
    os.close(fd)


@pytest.fixture
def threads():
    made: list[CopyThreads] = []

    def make(n: int = 2) -> CopyThreads:
        made.append(CopyThreads(n, "test-copy"))
        return made[-1]

    yield make
    for t in made:
        t.shutdown(wait=True, cancel_futures=True)


def table_of(rows: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 5)


def groups_of(rows: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def submit(
    pool: CopyThreads,
    arena: np.ndarray,
    offsets: np.ndarray,
    pids: np.ndarray,
    rows: np.ndarray,
    groups: np.ndarray,
    *,
    user: int = 1,
    to_host: bool = True,
    stream: bool = False,
    yield_bytes: int = 0,
    layers: int = 0,
    wake: int = 0,
    num_layers: int = 1,
) -> int:
    """``pool.submit_copy`` between ``arena`` and the engine regions ``rows``: its job."""
    (job,) = pool.submit_copy(
        user,
        arena.ctypes.data,
        arena.size,
        offsets,
        pids,
        rows,
        groups,
        to_host,
        stream,
        yield_bytes,
        layers,
        wake,
        num_layers,
    )
    return job


def one_page(pool: CopyThreads, arena: np.ndarray, view: np.ndarray, **kw: int) -> int:
    """``submit`` of engine page 0 to arena offset 0 over :func:`four_rows` of ``view``."""
    zero = np.zeros(1, dtype=np.int64)
    return submit(pool, arena, zero, zero, table_of(four_rows(view)), groups_of([(0, 4, 0)]), **kw)


def reap_all(pool: CopyThreads, jobs: int, timeout: float = 10.0) -> dict[int, tuple[int, int]]:
    """Wait on the eventfd until ``jobs`` copies have ended: {job: (status, pages)}."""
    out: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + timeout
    while len(out) < jobs:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(out)} of {jobs} copies ended"
        select.select([pool.fd], [], [], left)
        for job, status, pages in pool.reap():
            out[job] = (status, pages)
    return out


def four_rows(view: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    base = view.ctypes.data
    return [(i * ROW, base + ((3 * i) % 4) * N * ROW, N, ROW, ROW) for i in range(4)]


@pytest.mark.parametrize("stream", [False, True], ids=["memcpy", "stream"])
def test_a_region_copy_moves_what_the_one_call_copy_moves(engine, threads, stream):
    _, mm, view = engine
    pool = threads()
    rng = np.random.default_rng(3)
    offsets = np.array(rng.permutation(8 * N)[: N - 3], dtype=np.int64) * PAGE
    pids = np.array(rng.permutation(N)[: N - 3], dtype=np.int64)
    rows = table_of(four_rows(view))
    block = CompletionBlock.create_memfd(4)
    try:
        layers, _ = block.addresses(1)
        for to_host in (True, False):
            start = rng.integers(0, 256, 8 * PAGE * N, dtype=np.uint8)
            engine_start = view.copy()
            want = start.copy()
            assert guarded_copy.copy_regions(
                want.ctypes.data, want.size, offsets, pids, rows, to_host
            ) == 4 * len(pids)
            want_engine = view.copy()
            mm[:] = engine_start.tobytes()
            got = start.copy()
            job = submit(
                pool,
                got,
                offsets,
                pids,
                rows,
                groups_of([(0, 4, 0)]),
                user=7,
                to_host=to_host,
                stream=stream,
                layers=layers,
                num_layers=3,
            )
            assert reap_all(pool, 1) == {job: (ct.DONE, len(pids))}
            assert np.array_equal(got, want if to_host else start)
            assert np.array_equal(view, want_engine)
            assert block.read(1)[1] == 3  # every layer, once the copy ended
    finally:
        block.close()


def test_layers_are_announced_group_by_group_and_woken_only_when_asked(engine, threads):
    """A LOAD's groups announce their layers and bump the slot's wake counter (one per
    announcement, the last being every layer); a STORE's write the layers only."""
    _, _, view = engine
    pool = threads(1)
    rows = table_of(four_rows(view))
    groups = groups_of([(0, 1, 1), (1, 3, 2), (3, 4, 4)])
    offsets = np.arange(4, dtype=np.int64) * PAGE
    pids = np.array([3, 0, 9, 15], dtype=np.int64)
    arena = np.zeros(4 * PAGE, dtype=np.uint8)
    block = CompletionBlock.create_memfd(4)
    try:
        words = block._a  # the daemon's view of the slots
        for slot, woken in ((2, True), (3, False)):
            layers, wake = block.addresses(slot)
            assert layers == block._wbase + 8 * (slot * SLOT_WORDS + LAYERS_DONE)
            before = int(words[slot, WAKES])
            job = submit(
                pool,
                arena,
                offsets,
                pids,
                rows,
                groups,
                to_host=False,
                layers=layers,
                wake=wake if woken else 0,
                num_layers=5,
            )
            assert reap_all(pool, 1) == {job: (ct.DONE, 4)}
            assert int(words[slot, LAYERS_DONE]) == 5
            # groups 0 and 1 announce (the last group's layers come with the end): 3 wakes
            assert int(words[slot, WAKES]) - before == (3 if woken else 0)
    finally:
        block.close()
    with pytest.raises(ValueError, match="slot 4 is outside the block's 4 slots"):
        block.addresses(4)


def test_users_take_turns_across_native_and_python_jobs(engine, threads):
    """One thread, busy: user 1 queues two copies and a call, user 2 a call. The thread then
    runs user 1's first copy, user 2's call, user 1's second copy, user 1's call."""
    _, _, view = engine
    pool = threads(1)
    gate = threading.Event()
    blocker = pool.submit_for(9, gate.wait, 10)
    wait_running(blocker)
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    rows = table_of(four_rows(view))

    def copy(user: int, at: int) -> int:  # engine page 0 to host page ``at``
        return submit(
            pool,
            arena,
            np.array([at * PAGE], dtype=np.int64),
            np.zeros(1, dtype=np.int64),
            rows,
            groups_of([(0, 4, 0)]),
            user=user,
        )

    def seen() -> tuple[bool, bool]:  # which of the two copies had written its page
        return bool(arena[:PAGE].any()), bool(arena[PAGE : 2 * PAGE].any())

    a1, a2 = copy(1, 0), copy(1, 1)
    b = pool.submit_for(2, seen)
    a3 = pool.submit_for(1, seen)
    assert pool.queued() == {1: 3, 2: 1}
    gate.set()
    assert blocker.result(10) is True
    assert b.result(10) == (True, False)
    assert a3.result(10) == (True, True)
    assert set(reap_all(pool, 2)) == {a1, a2}
    assert pool.queued() == {}


def wait_running(fut) -> None:
    deadline = time.monotonic() + 10
    while not fut.running():
        assert time.monotonic() < deadline, "the copy thread never took the job"
        time.sleep(0.001)


def test_a_cancelled_copy_ends_cancelled_and_moves_nothing(engine, threads):
    _, _, view = engine
    pool = threads(1)
    gate = threading.Event()
    wait_running(pool.submit_for(1, gate.wait, 10))
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    job = submit(
        pool,
        arena,
        np.arange(4, dtype=np.int64) * PAGE,
        np.arange(4, dtype=np.int64),
        table_of(four_rows(view)),
        groups_of([(0, 4, 0)]),
    )
    assert pool.cancel(job)
    gate.set()
    assert reap_all(pool, 1) == {job: (ct.CANCELLED, 0)}
    assert not arena.any()
    assert not pool.cancel(job)  # ended: nothing to cancel


def test_a_shrunken_engine_memfd_ends_the_copy_short_naming_the_page(engine, threads):
    fd, _, view = engine
    pool = threads()
    base = view.ctypes.data
    os.ftruncate(fd, 2 * N * ROW + 5 * ROW)  # the second row's pages 5.. are gone
    rows = table_of([(0, base, N, ROW, ROW), (ROW, base + 2 * N * ROW, N, ROW, ROW)])
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    pids = np.array([0, 4, 7, 1], dtype=np.int64)
    job = submit(
        pool,
        arena,
        np.arange(4, dtype=np.int64) * PAGE,
        pids,
        rows,
        groups_of([(0, 1, 1), (1, 2, 2)]),
        user=3,
        num_layers=2,
    )
    assert reap_all(pool, 1) == {job: (ct.SHORT, 2)}  # index 2: page id 7 faulted


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([(0, 2, 1), (2, 3, 2)], r"groups end at row 3 of 4"),
        ([(1, 4, 0)], r"groups\[0\] = \(1, 4\): groups must cover the table's 4 rows in order"),
        ([(0, 2, 0), (3, 4, 0)], r"groups\[1\] = \(3, 4\)"),
        ([(0, 5, 0)], r"groups\[0\] = \(0, 5\)"),
        ([(0, 0, 0)], r"groups\[0\] = \(0, 0\)"),
        ([], r"a table with rows needs groups"),
    ],
)
def test_bad_groups_are_refused_and_nothing_is_queued(engine, threads, groups, match):
    _, _, view = engine
    pool = threads()
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    with pytest.raises(ValueError, match=match):
        submit(
            pool,
            arena,
            np.zeros(1, dtype=np.int64),
            np.zeros(1, dtype=np.int64),
            table_of(four_rows(view)),
            groups_of(groups),
        )
    assert pool.queued() == {}
    assert pool.reap() == []


def test_a_bad_index_is_refused_as_the_one_call_copy_refuses_it(engine, threads):
    _, _, view = engine
    pool = threads()
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"page_ids\[1\] = 16 is outside the regions' 16 pages"):
        submit(
            pool,
            arena,
            np.zeros(2, dtype=np.int64),
            np.array([0, 16], dtype=np.int64),
            table_of(four_rows(view)),
            groups_of([(0, 4, 0)]),
        )
    with pytest.raises(ValueError, match=r"yield_bytes = -1 must not be negative"):
        one_page(pool, arena, view, yield_bytes=-1)
    assert pool.queued() == {}


def test_shutdown_cancels_what_is_queued_and_takes_no_more(engine, threads):
    _, _, view = engine
    pool = threads(1)
    gate = threading.Event()
    running = pool.submit_for(1, gate.wait, 10)
    waiting = pool.submit_for(2, time.sleep, 0)
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    job = one_page(pool, arena, view, user=3)
    wait_running(running)
    stopper = threading.Thread(target=pool.shutdown, kwargs={"cancel_futures": True})
    stopper.start()
    assert reap_all(pool, 1) == {job: (ct.CANCELLED, 0)}
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert waiting.cancelled() and running.result() is True
    with pytest.raises(RuntimeError, match="the copy threads have shut down"):
        pool.submit_for(1, time.sleep, 0)
    with pytest.raises(RuntimeError, match="the copy threads have shut down"):
        one_page(pool, arena, view)


def test_a_split_copy_moves_what_one_copy_moves_and_announces_a_layer_once_every_part_has(
    engine, threads
):
    """Two parts on one busy thread, with another user's job between them: after the first
    part nothing is announced (the second has copied no layer); after both, every layer,
    with as many wake-ups as an unsplit copy makes."""
    _, _, view = engine
    pool = threads(1)
    gate = threading.Event()
    wait_running(pool.submit_for(9, gate.wait, 10))
    rows = table_of(four_rows(view))
    groups = groups_of([(0, 1, 1), (1, 3, 2), (3, 4, 4)])
    offsets = np.arange(6, dtype=np.int64) * PAGE
    pids = np.array([3, 0, 9, 15, 4, 7], dtype=np.int64)
    want = np.zeros(6 * PAGE, dtype=np.uint8)
    assert guarded_copy.copy_regions(want.ctypes.data, want.size, offsets, pids, rows, True) == 24
    arena = np.zeros(6 * PAGE, dtype=np.uint8)
    block = CompletionBlock.create_memfd(4)
    try:
        layers, wake = block.addresses(2)
        words = block._a
        before = int(words[2, WAKES])
        jobs = pool.submit_copy(
            1,
            arena.ctypes.data,
            arena.size,
            offsets,
            pids,
            rows,
            groups,
            True,
            False,
            0,
            layers,
            wake,
            5,
            np.array([0, 2, 6], dtype=np.int64),
        )
        between = pool.submit_for(2, lambda: (int(words[2, LAYERS_DONE]), bool(arena.any())))
        gate.set()
        assert between.result(10) == (0, True)  # part 0 copied, nothing announced
        assert reap_all(pool, 2) == {jobs[0]: (ct.DONE, 2), jobs[1]: (ct.DONE, 4)}
        assert np.array_equal(arena, want)
        assert int(words[2, LAYERS_DONE]) == 5
        assert int(words[2, WAKES]) - before == 3
    finally:
        block.close()


def test_a_part_that_faults_ends_short_and_the_others_still_end(engine, threads):
    fd, _, view = engine
    pool = threads()
    base = view.ctypes.data
    os.ftruncate(fd, N * ROW + 5 * ROW)  # row 0 (pages 0..15) stays; row 1 is gone
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    pids = np.array([0, 4, 7, 1], dtype=np.int64)

    def split(rows: np.ndarray, bounds: list[int]) -> list[int]:  # a STORE in two parts
        return pool.submit_copy(
            1,
            arena.ctypes.data,
            arena.size,
            np.arange(4, dtype=np.int64) * PAGE,
            pids,
            rows,
            groups_of([(0, 1, 0)]),
            True,
            False,
            0,
            0,
            0,
            1,
            np.array(bounds, dtype=np.int64),
        )

    ok = split(table_of([(0, base, N, ROW, ROW)]), [0, 1, 4])
    assert reap_all(pool, 2) == {ok[0]: (ct.DONE, 1), ok[1]: (ct.DONE, 3)}
    jobs = split(table_of([(0, base + N * ROW, N, ROW, ROW)]), [0, 2, 4])  # pages 5.. gone
    # part 0 (page ids 0, 4) copies; part 1 (7, 1) faults at its first page
    assert reap_all(pool, 2) == {jobs[0]: (ct.DONE, 2), jobs[1]: (ct.SHORT, 0)}


@pytest.mark.parametrize(
    ("bounds", "match"),
    [
        ([1, 4], r"bounds \(16 bytes\) must be int64 part starts from 0 and the end, 4"),
        ([0, 3], r"bounds \(16 bytes\) must be int64 part starts from 0 and the end, 4"),
        ([0], r"bounds \(8 bytes\) must be int64 part starts"),
        ([0, 2, 2, 4], r"bounds\[2\] = 2: each part needs a page"),
        ([0, 3, 1, 4], r"bounds\[2\] = 1: each part needs a page"),
    ],
)
def test_bad_bounds_are_refused_and_nothing_is_queued(engine, threads, bounds, match):
    _, _, view = engine
    pool = threads()
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    with pytest.raises(ValueError, match=match):
        pool.submit_copy(
            1,
            arena.ctypes.data,
            arena.size,
            np.arange(4, dtype=np.int64) * PAGE,
            np.arange(4, dtype=np.int64),
            table_of(four_rows(view)),
            groups_of([(0, 4, 0)]),
            True,
            False,
            0,
            0,
            0,
            1,
            np.array(bounds, dtype=np.int64),
        )
    assert pool.queued() == {}
    assert pool.reap() == []
