"""A node of the L1 radix tree, and the page-wise comparison of a node against a token run.

A node holds a run of whole pages as parallel Python lists (tokens, device page ids, page keys,
L2 flags), never as per-page objects, so that matching and splitting slice lists instead of
walking page records. The tree in :mod:`kvtier.client.radix.tree` owns every node and keeps
the invariants; this module only defines the node and how much of it a token run matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TreeNode", "common_pages"]


@dataclass(slots=True, eq=False)
class TreeNode:
    """A run of whole pages in the tree; identity-hashed.

    Args:
        node_id: Id from the tree's own counter (breaks LRU ties deterministically).
        parent: The node above; ``None`` for the root. Kept on nodes dropped from the tree so an
            outstanding :meth:`RadixTree.unlock` still reaches the ancestors.
        tokens: The run's tokens, ``page_size * n_pages`` of them.
        device: Per page, the device page id, or ``None`` once evicted from the device.
        keys: Per page, the 32-byte page key.
        in_l2: Per page, whether L2 holds the page.
        n_device: How many leading pages hold a device page.
        children: Child nodes by the tokens of their first page.
        lock_ref: Locks taken on this node or on any node below it.
        hit_count: Prefix matches that reached this node.
        last_access: Logical clock of the last match or insert that reached this node.
    """

    node_id: int
    parent: TreeNode | None
    tokens: list[int]
    device: list[int | None]
    keys: list[bytes]
    in_l2: list[bool]
    n_device: int = 0
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    hit_count: int = 0
    last_access: int = 0

    @property
    def n_pages(self) -> int:
        """The number of pages in the run."""
        return len(self.keys)


def common_pages(node: TreeNode, toks: list[int], start: int, page_size: int) -> int:
    """Count the leading whole pages of ``node`` equal to the pages of ``toks`` from ``start``.

    The caller found ``node`` by its first page, so that page is known to match and the count is
    at least 1. The whole run is compared in one slice first, the common case on a hit.

    Args:
        node: The node to compare.
        toks: The page-aligned token sequence.
        start: Where in ``toks`` the node's run would begin; a multiple of ``page_size``.
        page_size: Tokens per page.

    Returns:
        The number of leading pages of ``node`` that match, between 1 and ``node.n_pages``.
    """
    run = node.tokens
    end = start + len(run)
    if end <= len(toks) and toks[start:end] == run:
        return node.n_pages
    limit = min(len(run), len(toks) - start)
    k = page_size
    while k < limit and toks[start + k : start + k + page_size] == run[k : k + page_size]:
        k += page_size
    return k // page_size
