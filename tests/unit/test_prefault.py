"""The daemon builds its page tables over an engine's memory where the engine has pages, and
nowhere else (``daemon/transfer/prefault.py``).

Page tables are read from ``/proc/self/smaps`` (the ``Rss`` of one mapping: pages this
process has mapped), allocation from the memfd's ``st_blocks``.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from kvtier.daemon.transfer.prefault import (
    PAGE,
    STEP,
    Prefaulter,
    drop_page_tables,
    populate_resident,
)

MiB = 1 << 20


def mapped_kib(address: int) -> int:
    """The ``Rss`` (KiB) of this process's mapping that starts at ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        start = line.split("-", 1)[0]
        if all(c in "0123456789abcdef" for c in start) and int(start, 16) == address:
            for entry in lines[i + 1 :]:
                if entry.startswith("Rss:"):
                    return int(entry.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


class Memfd:
    """A memfd of ``size`` bytes, ``touched`` ranges allocated by the 'engine's' own mapping,
    and a second mapping of it (the 'daemon's') whose page tables start empty."""

    def __init__(self, size: int, touched: list[tuple[int, int]]) -> None:
        self.fd = os.memfd_create("prefault-test")
        os.ftruncate(self.fd, size)
        engine = mmap.mmap(self.fd, size)
        for start, n in touched:
            engine[start : start + n] = b"\x01" * n
        engine.close()
        self.map = mmap.mmap(self.fd, size)
        self.address = np.frombuffer(self.map, np.uint8).ctypes.data
        self.size = size

    def allocated(self) -> int:
        """Bytes of the file that have memory behind them."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


@pytest.fixture
def memfds():
    made: list[Memfd] = []
    yield lambda size, touched: made.append(Memfd(size, touched)) or made[-1]
    for m in made:
        m.close()


def test_resident_pages_are_mapped_without_a_fault_and_holes_stay_holes(memfds):
    m = memfds(8 * MiB, [(0, 2 * MiB), (5 * MiB, MiB)])
    assert m.allocated() == 3 * MiB and mapped_kib(m.address) == 0
    done, ok = populate_resident(m.address, m.size)
    assert ok and done == 3 * MiB
    assert mapped_kib(m.address) == 3 * 1024
    assert m.allocated() == 3 * MiB  # the holes were not filled


def test_a_sparse_engine_memory_costs_the_daemon_nothing(memfds):
    """An engine may hand over a huge file with nothing in it: nothing is allocated."""
    m = memfds(1 << 30, [(PAGE * 7, PAGE)])
    done, ok = populate_resident(m.address, m.size)
    assert ok and done == PAGE and m.allocated() == PAGE


def test_a_shrunk_file_ends_the_populate_without_a_signal(memfds):
    m = memfds(4 * MiB, [(0, 4 * MiB)])
    os.ftruncate(m.fd, MiB)  # the engine shrinks its memory under the daemon's mapping
    done, _ = populate_resident(m.address, m.size)  # no SIGBUS: the test process lives
    assert done <= MiB and mapped_kib(m.address) <= 1024


def test_the_thread_populates_every_range_in_steps(memfds):
    a = memfds(STEP + 3 * MiB, [(0, STEP + 3 * MiB)])
    b = memfds(2 * MiB, [(MiB, MiB)])
    pf = Prefaulter([(a.address, a.size), (b.address, b.size)], "test")
    pf.start()
    assert pf._thread is not None
    pf._thread.join(30)
    assert not pf.running
    assert pf.populated == a.size + MiB
    assert mapped_kib(a.address) == a.size // 1024 and mapped_kib(b.address) == 1024


def test_a_stopped_prefaulter_never_touches_the_mapping(memfds):
    m = memfds(4 * MiB, [(0, 4 * MiB)])
    pf = Prefaulter([(m.address, m.size)], "test")
    pf.stop()
    pf.start()
    assert not pf.running and pf.populated == 0 and mapped_kib(m.address) == 0


def test_stop_waits_for_the_step_in_progress(memfds):
    """Once stop() returns, the thread has left the mapping: what it populated no longer
    grows, so the daemon may unmap."""
    m = memfds(4 * STEP, [(0, 4 * STEP)])
    pf = Prefaulter([(m.address, m.size)], "test")
    pf.start()
    pf.stop()
    after = pf.populated
    assert pf._thread is not None
    pf._thread.join(30)
    assert pf.populated == after
    assert mapped_kib(m.address) == after // 1024


def test_dropped_page_tables_leave_the_engine_s_bytes_in_place(memfds):
    """drop_page_tables empties this process's mapping step by step (its Rss goes to 0) and
    only that: the file keeps its memory and its bytes, read back through the same mapping."""
    m = memfds(3 * MiB + PAGE, [(0, 3 * MiB + PAGE)])
    pattern = np.random.default_rng(5).integers(0, 256, m.size, dtype=np.uint8)
    m.map[:] = pattern.tobytes()
    assert mapped_kib(m.address) == m.size // 1024
    assert drop_page_tables(m.address, m.size, step=MiB) == m.size  # 4 steps, the last short
    assert mapped_kib(m.address) == 0
    assert m.allocated() == m.size
    assert bytes(m.map[:]) == pattern.tobytes()


def test_a_refused_drop_stops_and_says_how_far_it_got(memfds):
    """A step the kernel refuses (here: an address not on a page boundary) ends the drop
    with what came before it; nothing was dropped then."""
    m = memfds(2 * MiB, [(0, 2 * MiB)])
    m.map[:PAGE] = b"\x07" * PAGE  # this mapping's one page with a page table entry
    assert mapped_kib(m.address) == PAGE // 1024
    assert drop_page_tables(m.address + 1, m.size - PAGE, step=MiB) == 0
    assert mapped_kib(m.address) == PAGE // 1024 and m.map[0] == 7
