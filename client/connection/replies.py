"""What the daemon answered, as the engine-side client reports it: refusals, absence, lookups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgspec
from kvtier.config import KvtierError
from kvtier.ipc import protocol as P

__all__ = [
    "DaemonError",
    "DaemonUnavailable",
    "LookupReply",
    "UnexpectedReply",
    "expect",
    "rep_is_late",
]

ReplyT = TypeVar("ReplyT", bound=msgspec.Struct)


class DaemonError(KvtierError):
    """The daemon refused a request; ``code`` is the :class:`ErrorCode`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(
            f"{P.ErrorCode(code).name}: {message}"
            if code in P.ErrorCode._value2member_map_
            else message
        )
        self.code = code


class DaemonUnavailable(KvtierError):
    """The daemon did not answer in time (or is not running)."""


class UnexpectedReply(KvtierError):
    """The daemon answered a request with a reply of another type than the request's.

    A reply comes from another process: it is checked as data, never assumed. Callers treat
    this as they treat :class:`DaemonError` (a lookup reports a miss, a store is dropped).

    Attributes:
        request: the request's type name (``Lookup``).
        expected: the reply type that request is answered with.
        received: the type of the reply that came.
    """

    def __init__(self, request: str, expected: type, received: type) -> None:
        super().__init__(
            f"{request}: kvtierd answered {received.__name__}, expected {expected.__name__}"
        )
        self.request = request
        self.expected = expected
        self.received = received


def expect(request: P.Request, rep: P.Reply, kind: type[ReplyT]) -> ReplyT:
    """``rep`` as the ``kind`` of reply that answers ``request``.

    Raises:
        DaemonError: ``rep`` is an error reply (the daemon refused ``request``).
        UnexpectedReply: ``rep`` is a reply of another type.
    """
    if isinstance(rep, kind):
        return rep
    if isinstance(rep, P.ErrorReply):
        raise DaemonError(rep.code, rep.message)
    raise UnexpectedReply(type(request).__name__, kind, type(rep))


@dataclass(frozen=True, slots=True)
class LookupReply:
    """How many leading keys are in L2, and how many after those are in L3."""

    l2: int
    l3: int = 0


def rep_is_late(data: bytes, req_id: int) -> bool:
    """True unless ``data`` is the reply to ``req_id`` (then it is used even past the deadline)."""
    try:
        return P.decode_reply(data).req_id != req_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True
