"""Who gets a CPU first: the threads that answer requests, before the threads that copy.

A long STORE keeps every copy thread busy for tens of milliseconds (512 MiB for a 128K-token
context). On a node with as many copy threads as cores, the event loop, the ZeroMQ I/O
thread that hands it requests, and the engines' own threads then wait for a core on every
wake-up, behind copies that could as well run a millisecond later: another engine's
64-key LOOKUP, which its time to first token waits on, takes several times longer. The
daemon's own steps are short (sliced, :mod:`~kvtier.daemon.service.slices`); the wait is
for the CPU.

Two settings of the kernel's scheduler fix that without privileges:

- each copy thread runs at a higher nice value (:func:`lower_this_thread`, the
  ``copy_nice`` setting): its weight against a nice-0 thread is smaller (335 against 1,024
  at nice 5; 15 at nice 19), so a thread that wakes up to answer gets a core sooner. A copy
  still has every CPU nobody else wants, but it yields to every busy thread of the node,
  the engines' and unrelated processes' too: at nice 19 copies crawl on a node whose cores
  other processes keep busy, hence a mild default. An unprivileged process
  cannot lower a nice value again, hence one value for the threads' life.
- the event loop and the process's ZeroMQ I/O threads ask for a short time slice
  (:func:`ask_short_slice`, ``sched_setattr``'s ``sched_runtime`` for a normal thread):
  from Linux 6.12 (EEVDF's custom slices) a thread with a shorter slice preempts on its
  wake-up one with a longer one; earlier kernels ignore it. Its share of the CPU does not
  change, only how soon it gets it.

Both are best effort: where the call is missing (another OS, another architecture) or
refused, the thread keeps its default and the daemon says so once in its log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from pathlib import Path

__all__ = [
    "SCHED_SETATTR",
    "answering_threads_first",
    "ask_short_slice",
    "lower_this_thread",
    "zmq_io_threads",
]

log = logging.getLogger("kvtier.daemon")

SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
"""The ``sched_setattr`` system call's number on the architectures that have it named here
(Python has no wrapper for it)."""
_ATTR = struct.Struct("=IIQiIQQQ")  # struct sched_attr, its first version (48 bytes)
_SCHED_OTHER = 0


def lower_this_thread(nice: int) -> bool:
    """Raise the calling thread's nice value to ``nice`` (0 leaves it); False when refused.

    Linux keeps a nice value per thread (``setpriority`` on its thread id), so the rest of
    the process keeps its own.
    """
    if nice <= 0:
        return True
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as err:  # not Linux, or refused
        log.info("copy threads keep their CPU priority: nice %d refused (%s)", nice, err)
        return False
    return True


def ask_short_slice(tid: int, slice_us: int) -> bool:
    """Ask the kernel for a time slice of ``slice_us`` µs for thread ``tid`` (of this
    process), keeping its policy (normal) and nice value; False where the call is missing
    or refused (the thread keeps the default slice)."""
    number = SCHED_SETATTR.get(os.uname().machine)
    if number is None or slice_us <= 0:
        return False
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        attr = ctypes.create_string_buffer(
            _ATTR.pack(_ATTR.size, _SCHED_OTHER, 0, nice, 0, slice_us * 1000, 0, 0), _ATTR.size
        )
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, tid, attr, 0) != 0:
            err = ctypes.get_errno()
            log.info("thread %d keeps its time slice: sched_setattr: %s", tid, os.strerror(err))
            return False
    except (OSError, AttributeError) as err:
        log.info("thread %d keeps its time slice: %s", tid, err)
        return False
    return True


def zmq_io_threads(task_dir: Path = Path("/proc/self/task")) -> list[int]:
    """The thread ids of this process's ZeroMQ I/O threads (libzmq names them
    ``ZMQbg/IO/<n>``); empty where ``/proc`` is not there."""
    out: list[int] = []
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            if (t / "comm").read_text().startswith("ZMQbg/IO/"):
                out.append(int(t.name))
        except (OSError, ValueError):  # ended meanwhile
            continue
    return sorted(out)


def answering_threads_first(slice_us: int) -> list[int]:
    """Ask a ``slice_us`` µs time slice for the calling thread (the event loop) and this
    process's ZeroMQ I/O threads (call it once the sockets exist: libzmq starts its I/O
    threads with the first one); returns the threads that got it."""
    if slice_us <= 0:
        return []
    tids = [threading.get_native_id(), *zmq_io_threads()]
    return [t for t in tids if ask_short_slice(t, slice_us)]
