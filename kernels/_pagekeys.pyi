"""Types of the ``_pagekeys`` C extension (``kernels/_pagekeys.c``): the SHA-256 chain of
page keys; see :func:`kvtier.client.page_keys.page_keys`."""

from typing import Any, TypeAlias

from numpy.typing import NDArray
from typing_extensions import Buffer as _Bytes

Buffer: TypeAlias = _Bytes | NDArray[Any]

def chain(
    seed: Buffer,
    tokens: Buffer | list[int] | tuple[int, ...],
    page_bytes: int,
    portable: bool = ...,
    /,
) -> list[bytes] | None:
    """The keys of the whole pages of ``tokens`` (little-endian uint32, or ints), chained from
    ``seed``; None when a list's item is not exactly an int."""

def sha_extensions() -> bool:
    """Whether the CPU's SHA extensions hash (else portable C)."""
