"""Checks of a request's fields, shared by the handlers: each refuses with a RequestError.

A check changes nothing; the handler calls it before it touches the pool, a session or the
tier, so a refused request leaves no trace but its error reply (and the error counters).
"""

from __future__ import annotations

from kvtier.config import KvtierError
from kvtier.daemon.service.sessions import Session
from kvtier.ipc import protocol as P
from kvtier.ipc.limits import MAX_PID, MAX_SYNC_TIMEOUT_S

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
"""Policies a CLAIM may name (an empty policy means the daemon's own)."""


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
        keys: the page keys; each must have ``P.KEY_BYTES`` bytes.
        max_keys: ``max_keys_per_request``.
        pages: engine page indexes, one per key, all different (STORE, LOAD).
        num_pages: pages of the engine's registered memory.

    Raises:
        RequestError: BAD_MESSAGE (count, key length, duplicate page) or OUT_OF_RANGE.
    """
    if len(keys) > max_keys:
        raise RequestError(P.ErrorCode.BAD_MESSAGE,
                           f"{len(keys)} keys exceed max_keys_per_request ({max_keys})")
    if keys and (min(map(len, keys)) != P.KEY_BYTES or max(map(len, keys)) != P.KEY_BYTES):
        i = next(i for i, k in enumerate(keys) if len(k) != P.KEY_BYTES)
        raise RequestError(P.ErrorCode.BAD_MESSAGE,
                           f"keys[{i}] has {len(keys[i])} bytes, expected {P.KEY_BYTES}")
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


def check_pid(pid: int) -> None:
    """Check a REGISTER's ``pid``: 0 (unknown) or a process id Linux can hand out.

    A larger value cannot name a process (``os.kill`` would even raise OverflowError
    from 2**31 on), so it is refused here rather than checked for liveness later. The
    wire bounds refuse it at decode already; this keeps the daemon safe from a request
    built in-process.

    Raises:
        RequestError: BAD_MESSAGE naming the field.
    """
    if not 0 <= pid <= MAX_PID:
        raise RequestError(P.ErrorCode.BAD_MESSAGE,
                           f"pid = {pid!r} is not a process id (0 for unknown, or 1 to {MAX_PID})")


def check_policy(policy: str) -> None:
    """Check a CLAIM's prefetch policy (empty: the daemon's).

    Raises:
        RequestError: BAD_MESSAGE naming the policies allowed.
    """
    if policy and policy not in PREFETCH_POLICIES:
        raise RequestError(P.ErrorCode.BAD_MESSAGE, f"policy = {policy!r} is not one of "
                           f"{', '.join(PREFETCH_POLICIES)} (or empty for the daemon's)")


def check_sync_timeout(timeout_s: float) -> None:
    """Check a SYNC's ``timeout_s``: in (0, MAX_SYNC_TIMEOUT_S] seconds.

    Raises:
        RequestError: BAD_MESSAGE naming the field and the range.
    """
    if not (0 < timeout_s <= MAX_SYNC_TIMEOUT_S):
        raise RequestError(P.ErrorCode.BAD_MESSAGE, f"timeout_s = {timeout_s!r} is not in "
                           f"(0, {MAX_SYNC_TIMEOUT_S:g}] seconds")


def parse_namespace(text: str) -> bytes:
    """A FLUSH's ``namespace`` (hex text) as a fingerprint.

    Raises:
        RequestError: BAD_MESSAGE when the text is not hex.
    """
    try:
        return bytes.fromhex(text)
    except ValueError as err:
        raise RequestError(P.ErrorCode.BAD_MESSAGE, f"namespace = {text!r} is not hex") from err
