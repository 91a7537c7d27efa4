"""The full structural check of the L1 radix tree, used by its tests.

Kept out of the tree module because it re-derives, by walking every node, what the tree keeps
incrementally (key map, device and evictable counts, the eviction candidates); a bug in the
bookkeeping shows as a disagreement. It raises ``AssertionError`` explicitly rather than using
``assert``, so it checks the same under ``python -O``.
"""

from __future__ import annotations

from kvtier.client.radix.node import TreeNode

__all__ = ["check_tree_invariants"]


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def check_tree_invariants(
    root: TreeNode,
    page_size: int,
    by_key: dict[bytes, TreeNode],
    device_count: int,
    evictable_count: int,
    device_leaves: set[TreeNode],
    held_ids: set[int] | None = None,
) -> None:
    """Check every structural invariant of a tree against the bookkeeping it keeps.

    Args:
        root: The tree's root node.
        page_size: Tokens per page.
        by_key: The tree's map from page key to the node holding that page.
        device_count: The tree's count of pages that hold a device page.
        evictable_count: The tree's count of device pages in unlocked nodes.
        device_leaves: The tree's eviction candidates.
        held_ids: The tree's set of the device page ids it holds (None: not checked).

    Raises:
        AssertionError: An invariant does not hold; the message names it.
    """
    require = _require
    seen_keys: dict[bytes, TreeNode] = {}
    seen_ids: set[int] = set()
    device = evictable = 0
    leaves: set[TreeNode] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        n = node.n_pages
        require(node is root or n > 0, "empty node")
        require(len(node.tokens) == n * page_size, "tokens not page-aligned")
        require(len(node.device) == n == len(node.in_l2), "page lists differ in length")
        require(all(d is not None for d in node.device[: node.n_device]), "n_device")
        require(all(d is None for d in node.device[node.n_device :]), "device not prefix")
        require(all(d is not None or f for d, f in zip(node.device, node.in_l2)), "dead page")
        kids = list(node.children.values())
        require(node.n_device == n or all(c.n_device == 0 for c in kids), "device gap")
        locks = sum(c.lock_ref for c in kids)
        require(node is root or node.lock_ref >= locks, "lock_ref below children")
        for first, child in node.children.items():
            require(child.parent is node, "parent pointer")
            require(first == tuple(child.tokens[:page_size]), "child key")
        for key in node.keys:
            require(key not in seen_keys, "key twice")
            seen_keys[key] = node
        ids = node.device[: node.n_device]
        require(seen_ids.isdisjoint(ids) and len(set(ids)) == len(ids), "device id twice")
        seen_ids.update(ids)  # type: ignore[arg-type]
        device += node.n_device
        evictable += node.n_device if node.lock_ref == 0 else 0
        if node.n_device and (node.n_device < n or not any(c.n_device for c in kids)):
            leaves.add(node)
        stack.extend(kids)
    require(seen_keys == by_key, "key map")
    require(device == device_count, "device_page_count")
    require(held_ids is None or held_ids == seen_ids, "held device ids")
    require(evictable == evictable_count, "evictable_page_count")
    require(leaves == device_leaves, "device leaf set")
