"""What a request handler returns: a reply now, or a :class:`Deferred` one.

Most requests are answered on the spot, from the receive loop's reader callback. A handler
that must wait (L3 I/O, a CLAIM waiting for its prefetch, the other ranks of a group) returns
a :class:`Deferred` instead: the coroutine that will make the reply, which the receiver runs
in a task of its own while the loop keeps serving everyone else.

The types say which handler may wait: one declared ``-> P.Reply`` always answers at once;
one declared ``-> Answer`` may defer. Nothing looks at a value's run-time type to tell.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeAlias, final

from kvtier.ipc import protocol as P

__all__ = ["Answer", "Deferred", "Handler"]


@final
class Deferred:
    """A reply that a coroutine makes later.

    Args:
        pending: the coroutine; whoever receives the Deferred awaits it exactly once.
    """

    __slots__ = ("pending",)

    def __init__(self, pending: Coroutine[Any, Any, P.Reply]) -> None:
        self.pending = pending

    def __repr__(self) -> str:
        return f"Deferred({self.pending!r})"


Answer: TypeAlias = "P.Reply | Deferred"
"""A handler's result: the reply, or the coroutine that makes it."""

Handler: TypeAlias = Callable[..., Answer]
"""A request handler: (connection identity, request) → :data:`Answer`; REGISTER's also takes
the sender's credentials. Each request type has its own, typed with its request class; the
dispatcher's table maps the class to it."""
