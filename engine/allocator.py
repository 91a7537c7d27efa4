"""The reference engine's device page allocator: a free list over the KV pool's page ids.

Pages are plain ints ``[0, num_pages)``. The free list is a Python list used as a stack
(``alloc`` pops from the end, ``free`` pushes), so a page freed last is reused first and
neither call allocates per page beyond the returned list. A bitmap of allocated pages
catches double frees and frees of pages never handed out: both are bugs in the caller and
raise at once instead of corrupting a request's KV later.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.config.errors import KvtierError

__all__ = ["PageAllocator", "PageAllocatorError"]


class PageAllocatorError(KvtierError):
    """A page was freed twice, or freed without having been allocated."""


class PageAllocator:
    """Hands out device page ids of one engine's KV pool.

    Args:
        num_pages: Pages in the pool; ids are ``[0, num_pages)``.

    Raises:
        PageAllocatorError: ``num_pages`` is below 1.
    """

    __slots__ = ("_free", "_num_pages", "_used")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise PageAllocatorError(f"num_pages must be at least 1, got {num_pages!r}")
        self._num_pages = num_pages
        # Reversed so that the first allocations return 0, 1, 2, ... (easier to read in tests).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used = bytearray(num_pages)

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._num_pages

    @property
    def free_count(self) -> int:
        """Pages available to :meth:`alloc` now."""
        return len(self._free)

    @property
    def used_count(self) -> int:
        """Pages handed out and not yet freed."""
        return self._num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free pages.

        Args:
            n: How many pages (0 returns an empty list).

        Returns:
            The page ids, or None when fewer than ``n`` are free (nothing is taken then).

        Raises:
            PageAllocatorError: ``n`` is negative.
        """
        if n < 0:
            raise PageAllocatorError(f"cannot allocate {n!r} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        used = self._used
        for p in out:
            used[p] = 1
        return out

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list.

        Args:
            pages: Page ids from :meth:`alloc`, each freed once.

        Raises:
            PageAllocatorError: A page is out of range or not allocated (a double free); the
                pages before it in ``pages`` were freed.
        """
        used = self._used
        for p in pages:
            if not 0 <= p < self._num_pages or not used[p]:
                raise PageAllocatorError(f"page {p!r} is not allocated (double free or bad id)")
            used[p] = 0
            self._free.append(p)

    def reset(self) -> None:
        """Mark every page free (the caller has dropped every reference to them)."""
        self._free = list(range(self._num_pages - 1, -1, -1))
        self._used = bytearray(self._num_pages)
