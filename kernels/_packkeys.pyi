"""Types of the ``_packkeys`` C extension (``kernels/_packkeys.c``): page keys packed for
the wire."""

def pack_keys(keys: list[bytes], /) -> bytes | None:
    """The 32-byte keys back to back; None when an item is not bytes of exactly 32."""
