"""One failing spell of the L3 backend, logged once and then rarely, with its real cause.

A store that is down fails every retry (every second while it is down): logging each one
floods the log with the same line. :class:`FaultLog` logs the first failure of a spell at
once, then at most one line per :data:`REPEAT_S` carrying the count of failures it did not
log, and one recovery line when the spell ends. :func:`describe_fault` names the cause
from the exception itself (its class and errno, its cause chain included): a refused
connection reads "connection refused", a timeout "timed out", never one for the other.

Pure bookkeeping: the clock is injectable, so the rate limit is tested without waiting.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Callable

__all__ = ["REPEAT_S", "FaultLog", "describe_fault"]

REPEAT_S = 60.0
"""Least time between two log lines about one failing spell."""

_ERRNO_WORDS = {
    errno.ECONNREFUSED: "connection refused",
    errno.ETIMEDOUT: "timed out",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.ECONNRESET: "connection reset",
    errno.ECONNABORTED: "connection aborted",
    errno.EPIPE: "connection closed",
    errno.ENOSPC: "no space left on the device",
    errno.EACCES: "permission denied",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
}


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or while handling (at most 8)."""
    out: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in out and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _kind(err: BaseException) -> str | None:
    """The cause's kind named by the class or errno of one exception, None if neither tells."""
    if isinstance(err, socket.gaierror):
        return "name not resolved"
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, OSError) and err.errno in _ERRNO_WORDS:
        return _ERRNO_WORDS[err.errno]
    if isinstance(err, TimeoutError):
        return "timed out"
    name = type(err).__name__
    if name == "TimeoutError":  # a client library's own timeout class (redis-py has one)
        return "timed out"
    return None


def describe_fault(err: BaseException) -> str:
    """Name the cause of a backend fault, e.g. ``connection refused (ConnectionError: ...)``.

    Args:
        err: the exception a backend call (or its open) raised.

    Returns:
        The kind of fault, taken from the first exception of the chain (``err``, then what it
        was raised from) whose class or errno tells it, followed by ``err`` itself; just
        ``err`` when none tells.
    """
    text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    for link in _chain(err):
        kind = _kind(link)
        if kind is not None:
            return f"{kind} ({text})"
    return text


class FaultLog:
    """Logs the spells of one failing thing: once at the start, then rarely, then recovery.

    Args:
        log: where the lines go.
        what: names the thing, e.g. ``"L3 backend redis"``.
        repeat_s: least seconds between two lines of one spell (:data:`REPEAT_S`).
        clock: monotonic seconds (tests pass their own).

    Attributes:
        cause: the cause of the last failure of the current spell (None while healthy).
        failures: failures in the current spell.
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        repeat_s: float = REPEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.what = what
        self.repeat_s = repeat_s
        self.clock = clock
        self.cause: str | None = None
        self.failures = 0
        self._since = 0.0  # start of the spell
        self._logged_at = 0.0  # last line of the spell
        self._unlogged = 0  # failures since that line

    @property
    def failing(self) -> bool:
        """Whether a spell is going on (a failure and no recovery since)."""
        return self.cause is not None

    def failed(self, cause: str, consequence: str = "", level: int = logging.WARNING) -> None:
        """Record one failure: logged when it starts a spell, else at most every ``repeat_s``.

        Args:
            cause: what went wrong (see :func:`describe_fault`).
            consequence: appended to the first line, e.g. what keeps working meanwhile.
            level: the level of the spell's lines.
        """
        now = self.clock()
        self.failures += 1
        if self.cause is None:
            self.cause, self._since, self._logged_at, self._unlogged = cause, now, now, 0
            self.log.log(
                level, "%s: %s%s", self.what, cause, f"; {consequence}" if consequence else ""
            )
            return
        self.cause = cause
        self._unlogged += 1
        if now - self._logged_at >= self.repeat_s:
            self.log.log(
                level,
                "%s still failing for %.0f s: %s (%d more failures since the last line)",
                self.what,
                now - self._since,
                cause,
                self._unlogged,
            )
            self._logged_at, self._unlogged = now, 0

    def recovered(self, what_now: str = "healthy again") -> bool:
        """End the spell, if one is going on, with one info line.

        Args:
            what_now: how the line says it is back, e.g. ``"open"``.

        Returns:
            Whether a spell ended.
        """
        if self.cause is None:
            return False
        self.log.info(
            "%s %s after %d failures in %.0f s (last: %s)",
            self.what,
            what_now,
            self.failures,
            self.clock() - self._since,
            self.cause,
        )
        self.cause, self.failures, self._unlogged = None, 0, 0
        return True
