"""Types of the ``_packkeys`` C extension (``ipc/_packkeys.c``): page keys packed for the
wire, and the daemon's check of a packed request's pages."""

from collections.abc import Sequence

def pack_keys(keys: Sequence[bytes], /) -> bytes | None:
    """The 32-byte keys back to back; None when an item is not bytes of exactly 32."""

def check_pages(
    packed_pages: bytes | bytearray | memoryview, num_pages: int, /
) -> tuple[int, int] | None:
    """None when every little-endian uint32 page is below ``num_pages`` and none is there
    twice; else ``(1, i)`` for the first page out of range, or, when none is, ``(2, i)`` for
    the first page an earlier one repeats. ValueError: not whole uint32 pages."""
