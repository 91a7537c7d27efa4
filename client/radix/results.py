"""What the L1 radix tree's operations return: a prefix match, an insert, an evicted page.

Plain slotted records kept apart from the tree so that callers (the cache manager, the request
state) can name them without reaching into the tree's internals.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.client.radix.node import TreeNode

__all__ = ["EvictedPage", "InsertResult", "PrefixMatch"]


@dataclass(slots=True)
class PrefixMatch:
    """The whole pages of a token sequence found in the tree, in order.

    Args:
        page_ids: Per matched page, its device page id, or ``None`` when evicted from the device.
        keys: Per matched page, its key; ``keys[-1]`` continues the key chain.
        in_l2: Per matched page, whether L2 holds it.
        device_pages: Length of the leading run of pages on the device (the L1 hit).
        matched_tokens: ``len(page_ids) * page_size``.
        last_node: The node of the last matched page (the root when nothing matched); pass it to
            :meth:`RadixTree.lock` and :meth:`RadixTree.unlock`.
    """

    page_ids: list[int | None]
    keys: list[bytes]
    in_l2: list[bool]
    device_pages: int
    matched_tokens: int
    last_node: TreeNode

    @property
    def n_pages(self) -> int:
        """The number of matched pages."""
        return len(self.keys)

    @property
    def device_page_ids(self) -> list[int]:
        """The device page ids of the leading run on the device."""
        return self.page_ids[: self.device_pages]  # type: ignore[return-value]


@dataclass(slots=True)
class InsertResult:
    """What :meth:`RadixTree.insert` did.

    Args:
        duplicate_page_ids: Device page ids passed for pages that already hold a different
            device page; the tree did not take them and the caller must free them.
        last_node: The node of the last inserted page (the root when there were no full pages).
        new_pages: Pages added to the tree.
        refilled_pages: Pages that were in the tree without a device page and took one.
    """

    duplicate_page_ids: list[int]
    last_node: TreeNode
    new_pages: int
    refilled_pages: int


@dataclass(slots=True)
class EvictedPage:
    """A page freed from the device by :meth:`RadixTree.evict`.

    Args:
        page_id: The device page id, now free for the caller to reuse.
        key: The page key.
        in_l2: Whether L2 holds the page; if so it stays in the tree without a device page,
            otherwise it left the tree (together with every page after it).
        tokens: The page's tokens.
        parent: The key of the page before it in its chain (None: the chain's first page).
    """

    page_id: int
    key: bytes
    in_l2: bool
    tokens: tuple[int, ...]
    parent: bytes | None = None
