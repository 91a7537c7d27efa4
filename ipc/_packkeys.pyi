"""Types of the ``_packkeys`` C extension (``ipc/_packkeys.c``): page keys packed for the
wire."""

from collections.abc import Sequence

def pack_keys(keys: Sequence[bytes], /) -> bytes | None:
    """The 32-byte keys back to back; None when an item is not bytes of exactly 32."""
