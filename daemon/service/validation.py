"""Checks of a request's fields, shared by the handlers: each refuses with a RequestError.

Only what the decoder cannot know is checked here: every field's own bounds, choices and
key lengths are enforced when the request is decoded (``ipc/limits.py``); these checks
compare fields with the daemon's settings and a session's state. A check changes nothing;
the handler calls it before it touches the pool, a session or the tier, so a refused
request leaves no trace but its error reply (and the error counters).
"""

from __future__ import annotations

from kvtier.config import KvtierError
from kvtier.daemon.service.sessions import Session
from kvtier.ipc import protocol as P


class RequestError(KvtierError):
    """A request refused with an error code; nothing was changed.

    Args:
        code: the error code of the reply.
        message: what was wrong, naming the field.
    """

    def __init__(self, code: P.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_keys(keys: list[bytes], max_keys: int, pages: list[int] | None = None,
               num_pages: int = 0) -> None:
    """Check a request's page keys and, when given, the engine pages they map to.

    Args:
        keys: the page keys (their length was checked at decode).
        max_keys: ``max_keys_per_request``.
        pages: engine page indexes, one per key, all different (STORE, LOAD).
        num_pages: pages of the engine's registered memory.

    Raises:
        RequestError: BAD_MESSAGE (count, duplicate page) or OUT_OF_RANGE.
    """
    if len(keys) > max_keys:
        raise RequestError(P.ErrorCode.BAD_MESSAGE,
                           f"{len(keys)} keys exceed max_keys_per_request ({max_keys})")
    if pages is None:
        return
    if len(pages) != len(keys):
        raise RequestError(P.ErrorCode.BAD_MESSAGE, f"{len(keys)} keys but {len(pages)} pages")
    if pages and (min(pages) < 0 or max(pages) >= num_pages):
        i, p = next((i, p) for i, p in enumerate(pages) if not 0 <= p < num_pages)
        raise RequestError(P.ErrorCode.OUT_OF_RANGE,
                           f"pages[{i}] = {p!r} is outside the engine's {num_pages} pages")
    if len(set(pages)) != len(pages):
        raise RequestError(P.ErrorCode.BAD_MESSAGE, "pages contains the same page twice")


def check_lookup_keys(m: P.Lookup, max_keys: int) -> None:
    """Check a LOOKUP's keys, in either form (``keys`` or ``packed_keys``, not both).

    Raises:
        RequestError: BAD_MESSAGE (both forms, a partial packed key, too many keys).
    """
    if m.packed_keys:
        if m.keys:
            raise RequestError(P.ErrorCode.BAD_MESSAGE, "keys and packed_keys are both given")
        if len(m.packed_keys) % P.KEY_BYTES:
            raise RequestError(P.ErrorCode.BAD_MESSAGE,
                               f"packed_keys has {len(m.packed_keys)} bytes, not a multiple "
                               f"of {P.KEY_BYTES}")
    n = m.key_count()
    if n > max_keys:
        raise RequestError(P.ErrorCode.BAD_MESSAGE,
                           f"{n} keys exceed max_keys_per_request ({max_keys})")


def check_slot(s: Session, slot: int) -> None:
    """Check that ``slot`` is a completion slot of ``s`` with no transfer running.

    Raises:
        RequestError: OUT_OF_RANGE, or BUSY when a transfer still uses the slot.
    """
    if not 0 <= slot < s.completion.slots:
        raise RequestError(P.ErrorCode.OUT_OF_RANGE,
                           f"slot = {slot!r} is outside [0, {s.completion.slots})")
    if slot in s.transfers:
        raise RequestError(P.ErrorCode.BUSY, f"slot = {slot!r} has a transfer running")
