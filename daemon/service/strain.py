"""The daemon's record of running short of address space, memory, descriptors or threads.

When a request cannot get what it needs from the system (``mmap`` fails with ``ENOMEM``,
``accept`` with ``EMFILE``, a ``MemoryError``), that request alone is refused and the
event loop keeps serving. The shortage is noted here, and HEALTH answers
``degraded: <what>`` for :data:`HOLD_S` seconds after the latest one, so an operator sees
it even though the daemon still answers.
"""

from __future__ import annotations

import logging
import resource
import time

__all__ = ["HOLD_S", "Strain", "descriptor_limit", "raise_descriptor_limit"]

log = logging.getLogger("kvtier.daemon")

HOLD_S = 60.0
"""How long HEALTH reports a shortage after its latest occurrence."""


class Strain:
    """The latest shortage and when it happened (monotonic seconds).

    Attributes:
        count: shortages noted since the daemon started.
    """

    __slots__ = ("_at", "_what", "count")

    def __init__(self) -> None:
        self._what = ""
        self._at = 0.0
        self.count = 0

    def note(self, what: str) -> None:
        """Record a shortage; ``what`` says which resource and where (it is logged)."""
        if self._what != what or time.monotonic() - self._at > 1.0:
            log.warning("short of resources: %s", what)
        self._what = what
        self._at = time.monotonic()
        self.count += 1

    def problem(self) -> str | None:
        """The latest shortage when it is recent (within :data:`HOLD_S`), else None."""
        if self.count and time.monotonic() - self._at <= HOLD_S:
            return self._what
        return None


def descriptor_limit() -> int:
    """This process's soft limit on open descriptors (``RLIMIT_NOFILE``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_descriptor_limit(cap: int = 1 << 20) -> int:
    """Raise the soft descriptor limit to the hard one (at most ``cap``); the new soft limit.

    Engines hand their memory over as descriptors, so the daemon holds many for a while;
    the usual soft limit of 1,024 would make a few engines' handovers a shortage. Only
    ``kvtierd``'s own process calls this.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(cap, hard) if hard != resource.RLIM_INFINITY else cap
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as err:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, err)
    return descriptor_limit()
