"""A real kvtierd builds its page tables over a registered engine's memory right after
REGISTER, before any copy (``daemon/transfer/prefault.py``).

Without that, the first copy into each 4 KiB page of the engine's memory takes a page fault
in the daemon, which costs more than the copy (a 24 MiB load: 10-11 ms into untouched pages,
2.7 ms into touched ones), and which pages a load lands in is the engine's choice. The test
reads the daemon's ``/proc/<pid>/smaps``: the ``Rss`` of its mapping of the engine's memfd
grows to the whole (allocated) memory with no transfer sent, and falls to nothing once the
session is gone: unmapped on the daemon's unmap thread, off its event loop
(``daemon/service/unmaps.py``), as its stats and metrics count.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kvtier.client.connection.admin import AdminClient

from tests.engines import engine, fill_page, tokens

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0


def memfd_rss_kib(pid: int, name: str) -> list[int]:
    """The ``Rss`` (KiB) of each of ``pid``'s mappings of the memfd called ``name``."""
    out, current = [], False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            current = f"/memfd:{name}" in line
        elif current and fields[:1] == ["Rss:"]:
            out.append(int(fields[1]))
    return out


def test_the_daemon_maps_an_engine_s_pages_before_its_first_copy(daemon):
    pool, conn = engine(daemon.runtime_dir, num_pages=2048)  # 32 KiB pages: 64 MiB
    name = str(Path(f"/proc/self/fd/{pool.segment.fd}").readlink()).removeprefix("/memfd:")
    name = name.removesuffix(" (deleted)")
    try:
        assert daemon.proc is not None
        size_kib = pool.segment.size // 1024
        deadline = time.monotonic() + WAIT_S
        while (rss := memfd_rss_kib(daemon.proc.pid, name)) != [size_kib]:
            assert time.monotonic() < deadline, (
                f"the daemon's mapping holds {rss} KiB of {size_kib} KiB after {WAIT_S} s"
            )
            time.sleep(0.05)
    finally:
        conn.close()
        pool.close()
    deadline = time.monotonic() + WAIT_S
    while memfd_rss_kib(daemon.proc.pid, name):
        assert time.monotonic() < deadline, "the daemon still maps a closed session's memory"
        time.sleep(0.05)


def maps_inode(pid: int, inode: int) -> bool:
    """Whether ``pid`` maps the file whose inode is ``inode`` (memfds may share a name)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[4] == str(inode):
            return True
    return False


def unmaps(daemon) -> dict:
    with AdminClient(daemon.endpoint) as admin:
        limits = admin.stats()["limits"]
    return {**limits["unmaps"], "pending": limits["unmap_pending_bytes"]}


def test_a_closed_session_s_memory_is_unmapped_off_the_event_loop(daemon):
    """Each engine that leaves has its memory unmapped on the unmap thread, never on the
    loop: the counts say so, nothing waits once it is done, the daemon maps neither memfd
    any more, and it serves a third engine all along."""
    other_pool, other = engine(daemon.runtime_dir, num_pages=16)
    try:
        keys = other.page_keys(tokens(4 * other.geometry.page_size))
        for p in range(4):
            fill_page(other_pool, p, seed=p)
        assert other.store(keys, [0, 1, 2, 3]).wait()
        assert unmaps(daemon) == {"thread": 0, "at_once": 0, "pending": 0}
        inodes = []
        for n in range(2):
            pool, conn = engine(daemon.runtime_dir, num_pages=512, model=f"leaving-{n}")
            inodes.append(os.fstat(pool.segment.fd).st_ino)
            ks = conn.page_keys(tokens(8 * conn.geometry.page_size))
            assert conn.store(ks, list(range(8))).wait()
            assert maps_inode(daemon.proc.pid, inodes[-1]), "the engine's memory is mapped"
            conn.close()  # UNREGISTER
            pool.close()
            deadline = time.monotonic() + WAIT_S
            while (u := unmaps(daemon))["thread"] < n + 1:
                assert time.monotonic() < deadline, f"the memory never went to the thread: {u}"
                time.sleep(0.05)
            assert u["at_once"] == 0
            assert other.lookup(keys).l2 == 4  # served while and after the other left
        deadline = time.monotonic() + WAIT_S
        while (
            any(maps_inode(daemon.proc.pid, inode) for inode in inodes) or unmaps(daemon)["pending"]
        ):
            assert time.monotonic() < deadline, "the daemon still maps a closed session's memory"
            time.sleep(0.05)
        assert unmaps(daemon) == {"thread": 2, "at_once": 0, "pending": 0}
    finally:
        other.close()
        other_pool.close()
