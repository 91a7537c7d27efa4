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

pytestmark = pytest.mark.skipif(not guarded_copy.AVAILABLE,
                                reason="kvtier.kernels._guarded was not built (no C compiler)")
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


def test_pages_are_copied_both_ways(mapped):
    _, mm, view = mapped
    out = np.zeros(N * PAGE, dtype=np.uint8)
    assert guarded_copy.copy_pages(addrs(out.ctypes.data, range(N)),
                                   addrs(view.ctypes.data, range(N - 1, -1, -1)), PAGE) == N
    assert out.tobytes() == b"".join(mm[p * PAGE:(p + 1) * PAGE] for p in range(N - 1, -1, -1))
    out[:] = 7
    assert guarded_copy.copy_pages(addrs(view.ctypes.data, range(N)),
                                   addrs(out.ctypes.data, range(N)), PAGE) == N
    assert mm[:] == bytes([7]) * (N * PAGE)


def test_a_shrunken_mapping_stops_the_copy_where_it_faults_from_any_thread(mapped):
    fd, _, view = mapped
    out = np.zeros(N * PAGE, dtype=np.uint8)
    os.ftruncate(fd, 5 * PAGE)  # pages 5.. are gone: touching them is a SIGBUS
    order = [0, 1, 2, 9, 3]
    assert guarded_copy.copy_pages(addrs(out.ctypes.data, range(5)),
                                   [view.ctypes.data + p * PAGE for p in order], PAGE) == 3
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(guarded_copy.copy_pages(
        addrs(out.ctypes.data, range(N)), addrs(view.ctypes.data, range(N)), PAGE)))
        for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [5, 5, 5, 5]
    # writes fault the same way
    assert guarded_copy.copy_pages(addrs(view.ctypes.data, range(4, 8)),
                                   addrs(out.ctypes.data, range(4)), PAGE) == 1


def test_a_sigbus_outside_a_guarded_copy_still_ends_the_process():
    code = (
        "import mmap, os\n"
        "from kvtier.kernels import guarded_copy\n"
        "assert guarded_copy.AVAILABLE\n"
        "fd = os.memfd_create('x'); os.ftruncate(fd, 1 << 16)\n"
        "mm = mmap.mmap(fd, 1 << 16); os.ftruncate(fd, 0)\n"
        "mm[100]\n"
        "print('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)
    assert "survived" not in proc.stdout


def test_bad_arguments_are_refused_before_any_copy():
    with pytest.raises(ValueError, match="length"):
        guarded_copy.copy_pages([1], [2], 0)
    with pytest.raises(ValueError, match="1 dsts but 2 srcs"):
        guarded_copy.copy_pages([1], [2, 3], 8)
    with pytest.raises(TypeError):
        guarded_copy.copy_pages(5, [2], 8)
