"""One request's state in the cache manager: its match, and its L2 → device load.

:class:`MatchResult` is what
:meth:`CacheManager.match <kvtier.client.cache.manager.CacheManager.match>` returns and every
later call of the request passes back; :class:`LoadHandle` is the load the
forward pass waits on layer by layer. The handle reports its outcome through a callback, so it
does not depend on the manager that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from kvtier.client.cache.link import Transfer
from kvtier.client.radix.tree import TreeNode

__all__ = ["LoadHandle", "MatchResult", "SettledCallback"]


@dataclass(slots=True, eq=False)
class MatchResult:
    """One request's view of the cache, from :meth:`CacheManager.match` to its release.

    Attributes:
        tokens: the prompt.
        keys: the key of every full page of the prompt (the chain from the namespace).
        page_size: tokens per page.
        l1_pages: device pages of the L1 hit, in order; locked until release.
        l1_in_l2: per L1 page, whether the tree knows L2 holds it.
        l2_pages: pages right after the L1 hit that L2 holds (usable: the last token is kept).
        l3_pages: pages right after those that L3 holds.
        l3_coming: of those, pages the prefetch started by :meth:`CacheManager.match` brings
            into L2 (0: none started: L3 holds fewer than ``prefetch_threshold`` tokens
            there, or none of it can come); :meth:`CacheManager.load` claims them and loads
            what has arrived, as the prefetch policy says.
        node: the tree node locked for the request (moved by :meth:`CacheManager.insert`).
        load: the load started for the request, if any.
        loaded_pages: pages whose load completed (set when the load finishes).
        released: True once :meth:`CacheManager.release` ran.
        epoch: the daemon epoch of the tree's in-L2 marks when it matched (what it says of
            L2 is stale once the connection has registered with another).
        seed: the key chain's seed ``keys`` were made from (the namespace fingerprint then).
    """

    tokens: list[int]
    keys: list[bytes]
    page_size: int
    l1_pages: list[int]
    l1_in_l2: list[bool]
    l2_pages: int
    l3_pages: int
    node: TreeNode | None
    l3_coming: int = 0
    load: LoadHandle | None = None
    loaded_pages: int = 0
    released: bool = False
    epoch: int = 0
    seed: bytes = b""

    @property
    def l1_tokens(self) -> int:
        """Tokens of the L1 hit."""
        return len(self.l1_pages) * self.page_size

    @property
    def l2_tokens(self) -> int:
        """Tokens L2 holds after the L1 hit."""
        return self.l2_pages * self.page_size

    @property
    def l3_tokens(self) -> int:
        """Tokens L3 holds after the L2 run."""
        return self.l3_pages * self.page_size


SettledCallback: TypeAlias = "Callable[[LoadHandle, MatchResult, bool], None]"
"""Called once when a load ends: ``(handle, match, ok)``."""


class LoadHandle:
    """An L2 → device load for one request, waited on layer by layer.

    Attributes:
        pages: leading pages being loaded (0: nothing to load; then every wait succeeds).
        page_ids: the device pages being written, ``pages`` of them.
        quarantined: the load failed while the daemon lived; the manager holds
            ``page_ids`` until no late write can land, then sets this False. It frees them
            then if the request took fresh pages in their place
            (:meth:`CacheManager.recover_failed_load
            <kvtier.client.cache.manager.CacheManager.recover_failed_load>`: read this right
            after it, which tells whether the pages it returned are fresh) or freed them
            meanwhile; else they are the request's again.
    """

    __slots__ = (
        "__weakref__",
        "_match",
        "_ok",
        "_on_settled",
        "_transfer",
        "page_ids",
        "pages",
        "quarantined",
    )

    def __init__(
        self,
        match: MatchResult,
        transfer: Transfer | None,
        page_ids: Sequence[int],
        on_settled: SettledCallback,
    ) -> None:
        """Wrap ``transfer`` (None: nothing to load) for ``match``.

        Args:
            match: the request the load is for.
            transfer: the LOAD in flight, or None when nothing is loaded.
            page_ids: the device pages given to the load (only the first ``pages`` are written).
            on_settled: called once, with the handle, the match and the outcome, when the load
                ends (the cache manager records it there).
        """
        self._on_settled = on_settled
        self._match = match
        self._transfer = transfer
        self.pages = transfer.count if transfer is not None else 0
        self.page_ids = list(page_ids[: self.pages])
        self._ok: bool | None = None if self.pages else True
        self.quarantined = False

    @property
    def tokens(self) -> int:
        """Tokens being loaded."""
        return self.pages * self._match.page_size

    @property
    def failed(self) -> bool:
        """True once a wait reported a failure (the pages must not be used)."""
        return self._ok is False

    def copying(self) -> bool:
        """Whether kvtierd may still write this load's pages (it has not ended it, and lives)."""
        return self._transfer is not None and self._transfer.copying()

    def wait_layer(self, layer: int) -> bool:
        """Block until layer ``layer`` of every loaded page is in place.

        Args:
            layer: layer index, called in order by the forward pass.

        Returns:
            True when it is; False when the load failed (daemon gone, timeout): the engine must
            then recompute everything after the L1 hit and never read these pages.
        """
        if self._ok is not None:
            return self._ok
        assert self._transfer is not None
        if not self._transfer.wait_layer(layer):
            self._settle(False)
            return False
        return True

    def finish(self) -> bool:
        """Wait for the whole load to end and record its outcome; idempotent.

        Returns:
            True when every page is in place (or nothing was loaded), else False.
        """
        if self._ok is None:
            assert self._transfer is not None
            self._settle(self._transfer.wait())
        return bool(self._ok)

    def _settle(self, ok: bool) -> None:
        """Record the outcome once and tell the manager."""
        self._ok = ok
        self._on_settled(self, self._match, ok)
