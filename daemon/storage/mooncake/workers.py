"""The Mooncake backend's worker threads.

Mooncake's batch calls busy-poll their calling thread until the transfer is done, so the
workers run at a lower priority (``worker_nice``): on a node whose cores are all busy the
poll then gives way to the threads that move the bytes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["shutdown_then", "worker_pool"]

_log = logging.getLogger(__name__)


def worker_pool(workers: int, nice: int) -> ThreadPoolExecutor:
    """Return a pool of ``workers`` threads, each ``nice`` lower in priority than the daemon."""
    return ThreadPoolExecutor(
        workers,
        thread_name_prefix="kvtier-mooncake",
        initializer=_lower_priority,
        initargs=(nice,),
    )


def _lower_priority(nice: int) -> None:
    """Initializer of the worker threads: raise this thread's nice value by ``nice`` (Linux
    gives each thread its own); a refusal is logged and the thread runs as it is."""
    if nice <= 0:
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as err:
        _log.warning("mooncake backend: could not lower a worker's priority: %s", err)


def shutdown_then(pool: ThreadPoolExecutor, then: Callable[[], None]) -> None:
    """Wait for the pool's jobs to finish, then run ``then`` (blocking: run it in a thread)."""
    pool.shutdown(wait=True)
    then()
