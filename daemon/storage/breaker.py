"""A circuit breaker for a remote L3 store (Redis, a Mooncake master).

A store that stops answering must not stall the daemon, nor flood its log. The breaker
counts consecutive faults; at ``threshold`` it opens: operations are refused (they read
as misses) for ``cooldown_s``, then it is half-open: one operation per cool-down is let
through to try the store again, and the first success closes it::

    CLOSED --threshold faults--> OPEN --cooldown_s--> HALF_OPEN --success--> CLOSED
                                   ^                      |
                                   +-------fault----------+

It logs once per failing spell: a warning when it opens, an info line when it closes.
With ``cooldown_s = 0`` nothing is ever refused and the breaker only tracks (and logs)
the failing spell: the Redis backend, whose client reconnects by itself, uses it so.

Not thread-safe: a backend calls it from the event loop only.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

__all__ = ["Breaker", "BreakerState"]


class BreakerState(enum.Enum):
    """Where a :class:`Breaker` stands."""

    CLOSED = "closed"
    """The store answers: every operation goes through."""
    OPEN = "open"
    """The store failed: operations are refused until the cool-down ends."""
    HALF_OPEN = "half-open"
    """The cool-down is over: the next operation goes through to try the store."""


class Breaker:
    """Admits or refuses operations on a remote store after its recent faults.

    Args:
        what: names the store in log lines, e.g. ``"redis backend: redis://10.0.0.7:6379/0"``.
        cooldown_s: how long operations are refused once the breaker opens (>= 0).
        threshold: consecutive faults that open the breaker (>= 1).
        clock: monotonic seconds (``time.monotonic``; tests pass their own).
        log: where the open / close lines go.

    Raises:
        ValueError: ``cooldown_s`` < 0 or ``threshold`` < 1 (a programming error).
    """

    __slots__ = (
        "_clock",
        "_faults",
        "_log",
        "_open",
        "_retry_at",
        "cooldown_s",
        "threshold",
        "what",
    )

    def __init__(
        self,
        what: str,
        cooldown_s: float,
        threshold: int = 1,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
    ) -> None:
        if cooldown_s < 0 or threshold < 1:
            raise ValueError(f"breaker: cooldown_s={cooldown_s}, threshold={threshold}")
        self.what = what
        self.cooldown_s = cooldown_s
        self.threshold = threshold
        self._clock = clock
        self._log = log or logging.getLogger(__name__)
        self._faults = 0  # consecutive, since the last success
        self._open = False  # threshold reached and no success since
        self._retry_at = 0.0

    @property
    def failing(self) -> bool:
        """Whether the breaker is open or half-open (the store has not answered since)."""
        return self._open

    @property
    def state(self) -> BreakerState:
        """The current state (see the module docstring)."""
        if not self._open:
            return BreakerState.CLOSED
        return BreakerState.OPEN if self._clock() < self._retry_at else BreakerState.HALF_OPEN

    def admit(self) -> bool:
        """Whether an operation may reach the store now.

        Returns:
            True when closed; when half-open, True for one operation, which starts a new
            cool-down (so one operation per cool-down tries the store); False when open.
        """
        if not self._open:
            return True
        now = self._clock()
        if now < self._retry_at:
            return False
        self._retry_at = now + self.cooldown_s
        return True

    def failed(self, why: str) -> None:
        """Record a fault (``why`` goes to the log line when this opens the breaker)."""
        self._faults += 1
        if self._faults < self.threshold:
            return
        self._retry_at = self._clock() + self.cooldown_s
        if not self._open:
            self._open = True
            self._log.warning(
                "%s unreachable or failing (%s); L3 reads miss until it answers", self.what, why
            )

    def succeeded(self) -> None:
        """Record that the store answered: close the breaker."""
        self._faults = 0
        if self._open:
            self._open = False
            self._retry_at = 0.0
            self._log.info("%s answers again", self.what)
