"""Copies that give their CPU up (``yield_bytes`` of ``kernels/_guarded.c``) and which
copies the daemon asks it of (``copy_yield_bytes``, the ``copy_yield_kib`` setting).

A long STORE's copy yields every ``copy_yield_kib`` KiB so that a thread that wakes up on
its CPU (the event loop, another engine answering its own request) runs at once, not at
the scheduler's next tick. The bytes are the same either way; what changes is that the
copying thread is switched out at each yield when another thread is waiting for its CPU,
which a process pinned to one CPU with a busy second thread shows in the copying thread's
involuntary context switches (a yield that hands the CPU over counts as one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from kvtier.config import ConfigError, DaemonConfig, load_config
from kvtier.daemon.service.transfers import copy_yield_bytes
from kvtier.daemon.transfer.transfer import Direction
from kvtier.kernels import guarded_copy

PAGE = 64 << 10
N = 24

native = pytest.mark.skipif(
    not guarded_copy.strided(), reason="kvtier.kernels._guarded was not built (no C compiler)"
)


def _pages(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, N * PAGE, dtype=np.uint8)


@native
@pytest.mark.parametrize("every", [1, PAGE, 3 * PAGE + 5, 1 << 30])
def test_copies_that_yield_move_the_same_bytes(every):
    engine = _pages(1)
    pids = np.random.default_rng(2).permutation(N).astype(np.int64)
    offsets = np.arange(N, dtype=np.int64)[::-1].copy() * PAGE
    want = np.zeros_like(engine)
    assert (
        guarded_copy.copy_strided(
            want.ctypes.data, want.size, offsets, 0, engine.ctypes.data, N, pids, PAGE, PAGE, True
        )
        == N
    )
    got = np.zeros_like(engine)
    assert (
        guarded_copy.copy_strided(
            got.ctypes.data,
            got.size,
            offsets,
            0,
            engine.ctypes.data,
            N,
            pids,
            PAGE,
            PAGE,
            True,
            False,
            every,
        )
        == N
    )
    assert np.array_equal(got, want)
    table = np.array([(0, engine.ctypes.data, N, PAGE, PAGE)], dtype=np.int64)
    got[:] = 0
    assert (
        guarded_copy.copy_regions(
            got.ctypes.data, got.size, offsets, pids, table, True, True, every
        )
        == N
    )
    assert np.array_equal(got, want)
    back = np.zeros_like(engine)
    dsts = [back.ctypes.data + p * PAGE for p in range(N)]
    srcs = [engine.ctypes.data + p * PAGE for p in range(N)]
    assert guarded_copy.copy_pages(dsts, srcs, PAGE, False, every) == N
    assert np.array_equal(back, engine)


@native
def test_a_negative_yield_is_refused_before_any_byte_moves():
    engine, arena = _pages(3), np.zeros(N * PAGE, dtype=np.uint8)
    pids = np.arange(N, dtype=np.int64)
    offsets = pids * PAGE
    table = np.array([(0, engine.ctypes.data, N, PAGE, PAGE)], dtype=np.int64)
    with pytest.raises(ValueError, match=r"yield_bytes = -1 must not be negative"):
        guarded_copy.copy_strided(
            arena.ctypes.data,
            arena.size,
            offsets,
            0,
            engine.ctypes.data,
            N,
            pids,
            PAGE,
            PAGE,
            True,
            False,
            -1,
        )
    with pytest.raises(ValueError, match=r"yield_bytes = -7 must not be negative"):
        guarded_copy.copy_regions(
            arena.ctypes.data, arena.size, offsets, pids, table, True, False, -7
        )
    with pytest.raises(ValueError, match=r"yield_bytes = -2 must not be negative"):
        guarded_copy.copy_pages([arena.ctypes.data], [engine.ctypes.data], PAGE, False, -2)
    assert not arena.any()


_PINNED = textwrap.dedent(
    """
    import json, os, resource, sys, threading
    import numpy as np
    from kvtier.kernels import guarded_copy

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread, and those it starts
    PAGE, N = 64 << 10, 64
    engine = np.ones(N * PAGE, dtype=np.uint8)
    arena = np.zeros(N * PAGE, dtype=np.uint8)
    pids = np.arange(N, dtype=np.int64)
    table = np.array([(0, engine.ctypes.data, N, PAGE, PAGE)], dtype=np.int64)
    stop = False

    def busy():  # the thread that waits for this CPU while the copy runs
        n = 0
        while not stop:
            n += 1

    # first touch of both arrays (page faults) before the thread starts: a copy measured
    # below takes its usual time, not that of faulting its pages in
    guarded_copy.copy_regions(arena.ctypes.data, arena.size, pids * PAGE, pids, table, True, False, 0)
    t = threading.Thread(target=busy)
    t.start()
    out = {}
    for every in (0, PAGE, 0, PAGE):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        done = guarded_copy.copy_regions(
            arena.ctypes.data, arena.size, pids * PAGE, pids, table, True, False, every
        )
        after = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        assert done == N, done
        out.setdefault(str(every), []).append(after - before)
    stop = True
    t.join()
    print(json.dumps(out))
    """
)


@native
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_a_copy_that_yields_lets_a_waiting_thread_run_at_each_yield():
    """64 pages with a yield after each, on one CPU shared with a busy thread: the copying
    thread is switched out at many of its yields (whenever the waiting thread's turn has
    come; about a third here); without yields only by the scheduler's tick, a few times at
    most in a copy that takes well under a millisecond alone."""
    run = subprocess.run(
        [sys.executable, "-c", _PINNED], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    switches = json.loads(run.stdout.strip().splitlines()[-1])
    yielding, plain = switches[str(PAGE)], switches["0"]
    assert min(yielding) >= 8, switches  # 64 yields, each with a thread waiting
    assert min(yielding) > 4 * max(max(plain), 1), switches


def test_only_a_long_store_yields_and_the_setting_sets_how_often():
    cfg = DaemonConfig(slice_pages=512, copy_yield_kib=256)
    assert copy_yield_bytes(cfg, Direction.STORE, 513) == 256 << 10
    assert copy_yield_bytes(cfg, Direction.STORE, 512) == 0  # not sliced: ends in a slice
    assert copy_yield_bytes(cfg, Direction.LOAD, 1 << 20) == 0  # its engine waits on it
    off = DaemonConfig(slice_pages=512, copy_yield_kib=0)
    assert copy_yield_bytes(off, Direction.STORE, 1 << 20) == 0
    assert DaemonConfig().copy_yield_kib == 256


@pytest.mark.parametrize("value", ["-1", "2097152", "lots"])
def test_a_bad_copy_yield_kib_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv("KVTIER_COPY_YIELD_KIB", value)
    with pytest.raises(ConfigError, match="copy_yield_kib"):
        load_config(DaemonConfig)
