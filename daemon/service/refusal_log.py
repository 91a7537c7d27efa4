"""Refusals logged once, then rarely: a client that repeats a refused request cannot flood
the log.

Any local user can open the handover socket or send a REGISTER or an admin request with a
wrong token, thousands of times a second. Each kind of refusal (keyed by what the caller
chooses: the reason and the sender's uid, the tenant) is logged at once the first time,
then at most once per :data:`REPEAT_S`; that line carries how many of the same were not
logged since the last one. An operator still reads one line per kind of refusal, and the
count says how hard it was tried.

Pure bookkeeping: the clock is injectable, so the rate limit is tested without waiting.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

__all__ = ["MAX_KEYS", "REPEAT_S", "RefusalLog"]

REPEAT_S = 60.0
"""Least time between two lines about one kind of refusal."""

MAX_KEYS = 1024
"""Kinds of refusal remembered at once; the least recently seen is forgotten first (its
next refusal is logged at once, as a first one)."""


class RefusalLog:
    """Log refusals of one kind once per :data:`REPEAT_S`, counting those in between.

    Args:
        logger: where the lines go.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._clock = clock
        self._seen: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()  # last line, held

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless a line of kind ``key`` was logged less
        than :data:`REPEAT_S` ago (then it is only counted); whether it was logged."""
        if not self._log.isEnabledFor(level):
            return False
        now = self._clock()
        last = self._seen.get(key)
        if last is not None:
            self._seen.move_to_end(key)
            if now - last[0] < REPEAT_S:
                self._seen[key] = (last[0], last[1] + 1)
                return False
        held = last[1] if last is not None else 0
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_KEYS:
            self._seen.popitem(last=False)
        if held:
            msg += " (%d more like it not logged in the last %gs)"
            args = (*args, held, min(REPEAT_S, now - last[0]) if last is not None else REPEAT_S)
        self._log.log(level, msg, *args)
        return True
