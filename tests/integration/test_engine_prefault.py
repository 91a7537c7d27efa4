"""A real kvtierd builds its page tables over a registered engine's memory right after
REGISTER, before any copy (``daemon/transfer/prefault.py``).

Without that, the first copy into each 4 KiB page of the engine's memory takes a page fault
in the daemon, which costs more than the copy (a 24 MiB load: 10-11 ms into untouched pages,
2.7 ms into touched ones), and which pages a load lands in is the engine's choice. The test
reads the daemon's ``/proc/<pid>/smaps``: the ``Rss`` of its mapping of the engine's memfd
grows to the whole (allocated) memory with no transfer sent, and falls to nothing once the
session is gone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engines import engine

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
