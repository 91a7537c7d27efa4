"""What the daemon answered, as the engine-side client reports it: refusals, absence, lookups."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from kvtier.config import KvtierError
from kvtier.ipc import protocol as P

__all__ = ["DaemonError", "DaemonUnavailable", "LookupReply", "rep_is_late"]


class DaemonError(KvtierError):
    """The daemon refused a request; ``code`` is the :class:`ErrorCode`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{P.ErrorCode(code).name}: {message}" if code in P.ErrorCode._value2member_map_
                         else message)
        self.code = code


class DaemonUnavailable(KvtierError):
    """The daemon did not answer in time (or is not running)."""


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
