"""What the cache manager needs from its link to kvtierd, as protocols.

:class:`~kvtier.client.connection.connection.Connection` is one such link (the daemon copies
pages between its pool and the engine's memory); :class:`~kvtier.client.cache.staged.StagedConnection`
is the other (the engine copies pages between its device and a staging area, the daemon
between the staging area and its pool). The manager, its store tracker and its load handles
are written against these protocols, so either link serves them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.client.connection.replies import LookupReply
from kvtier.config import ClientConfig
from kvtier.ipc.protocol import Geometry

__all__ = ["CacheLink", "Transfer"]


class Transfer(Protocol):
    """A STORE or LOAD in flight (:class:`~kvtier.client.connection.transfer_handle.TransferHandle`).

    Attributes:
        count: a load's leading pages being loaded (0: a miss); a store's leading keys now
            in L2 or being written by it (the rest were dropped, or are another store's).
        writing: pages actually being copied.
    """

    count: int
    writing: int

    @property
    def ok(self) -> bool:
        """True when the transfer ended and every layer completed."""
        ...

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` is in place; False: failed, recompute."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the transfer ends; True when it succeeded."""
        ...

    def copying(self) -> bool:
        """Whether kvtierd may still copy to or from the engine's pages of a transfer whose
        wait failed (those pages stay out of use until this returns False)."""
        ...


class CacheLink(Protocol):
    """A registered engine rank's link to kvtierd, as the cache manager uses it.

    Attributes:
        geometry: the page geometry registered.
        config: the client settings.
    """

    geometry: Geometry
    config: ClientConfig

    @property
    def ns_fingerprint(self) -> bytes:
        """The namespace's fingerprint (32 bytes once registered): the key chain's seed."""
        ...

    @property
    def epoch(self) -> int:
        """The epoch of the daemon it last registered with (a restarted daemon has another:
        what L2 held before may be gone)."""
        ...

    def lookup(self, keys: Sequence[bytes]) -> LookupReply:
        """How many leading ``keys`` L2 and L3 hold."""
        ...

    def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> Transfer:
        """Load the leading L2 run of ``keys`` into the engine's ``pages``, layer by layer."""
        ...

    def store(
        self, keys: Sequence[bytes], pages: Sequence[int], parent_key: bytes | None = None
    ) -> Transfer:
        """Copy the engine's ``pages`` into L2 under ``keys``."""
        ...

    def daemon_alive(self) -> bool:
        """False when the daemon's process is known to be gone."""
        ...

    def prefetch_coming(self, keys: Sequence[bytes], skip: int = 0) -> int:
        """Start filling L2 from L3 with the run of ``keys`` after the first ``skip``; how
        many of those pages are in L2 or coming (0: none)."""
        ...

    def claim(self, keys: Sequence[bytes]) -> int:
        """End the prefetch of ``keys`` as the prefetch policy says; the leading run of
        ``keys`` now in L2."""
        ...

    @property
    def store_room(self) -> tuple[int, int]:
        """``(stores, pages)``: how many STOREs, of how many pages in all, may be in flight
        before a new one would find the link's slots taken (and be dropped)."""
        ...

    @property
    def load_room(self) -> tuple[int, int]:
        """``(loads, pages)``: how many LOADs, of how many pages in all, may be in flight
        and leave :attr:`store_room` to STOREs."""
        ...
