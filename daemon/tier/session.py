"""What the L3 tier needs of an engine session, as a protocol.

The sessions themselves live in the service layer (:class:`kvtier.daemon.service.sessions.
Session`), above the tier; the tier names only the fields it reads and the two it keeps
(``prefetches``, ``member``), so it depends on no module of the service.
"""

from __future__ import annotations

from typing import Protocol

from kvtier.daemon.tier.prefetch import PrefetchJob
from kvtier.daemon.tier.rank_groups import Member
from kvtier.ipc.protocol import Geometry


class TierSession(Protocol):
    """One engine session as the tier sees it.

    Attributes:
        ns_id / ns_fingerprint: its namespace (pool id, and the fingerprint that names its
            pages in L3).
        owner / class_id: its pool owner id and host-pool page class.
        geometry: page shape (``page_size`` tokens, ``page_bytes`` bytes per page).
        prefetches: unclaimed prefetches, by request id (or a chain's last key); the tier
            adds, ends and clears them.
        member: its place in a TP rank group (None when ``tp_size`` is 1); the tier drops
            it when the session closes.
    """

    ns_id: int
    ns_fingerprint: bytes
    owner: int
    class_id: int
    geometry: Geometry
    prefetches: dict[str | bytes, PrefetchJob]
    member: Member | None

    def is_open(self) -> bool:
        """Whether the session still accepts requests."""
        ...
