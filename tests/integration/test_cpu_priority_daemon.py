"""A real kvtierd's threads as the kernel sees them (``/proc``): its copy threads run at
``copy_nice``, every other thread at the process's own nice value (the unmap thread, made
when a session first ends, at nice 19: ``tests/unit/test_unmaps.py``), and its event loop
and ZeroMQ I/O thread ask for ``loop_slice_us``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kvtier.config import DaemonConfig

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc"),
]
DEADLINE_S = 20.0


def nice_of_threads(pid: int) -> dict[int, int]:
    """Each thread of ``pid`` and its nice value (``stat``'s 19th field)."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (t / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        out[int(t.name)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def slice_ns(pid: int, tid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/task/{tid}/sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("se.slice"):
            return int(line.split(":")[1])
    return None


@pytest.mark.parametrize("flags", [(), ("--copy-nice", "19")], ids=["default", "19"])
def test_the_copy_threads_run_at_copy_nice_and_nothing_else_does(daemon_factory, flags):
    want = int(flags[1]) if flags else DaemonConfig().copy_nice
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= want:
        pytest.skip(f"the tests run at nice {base} already")
    d = daemon_factory("--copy-threads", "3", *flags)
    nice = nice_of_threads(d.pid)
    assert sorted(n for n in nice.values() if n == want) == [want] * 3, nice
    assert nice[d.pid] == base
    assert all(n in (base, want) for n in nice.values()), nice


def test_copy_nice_0_keeps_the_copy_threads_at_the_daemons_priority(daemon_factory):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    d = daemon_factory("--copy-threads", "3", "--copy-nice", "0")
    assert set(nice_of_threads(d.pid).values()) == {base}


def test_the_event_loop_asks_for_a_short_slice(daemon_factory):
    d = daemon_factory("--loop-slice-us", "250")
    if slice_ns(d.pid, d.pid) is None:
        pytest.skip("this kernel does not show a thread's slice (/proc/<tid>/sched)")
    end = time.monotonic() + DEADLINE_S  # asked once the daemon is ready: soon after HEALTH
    while slice_ns(d.pid, d.pid) != 250_000 and time.monotonic() < end:
        time.sleep(0.05)
    assert slice_ns(d.pid, d.pid) == 250_000
    io = [
        int(t.name)
        for t in Path(f"/proc/{d.pid}/task").iterdir()
        if (t / "comm").read_text().startswith("ZMQbg/IO/")
    ]
    assert io, "kvtierd's ZeroMQ I/O thread"
    assert all(slice_ns(d.pid, t) == 250_000 for t in io)
