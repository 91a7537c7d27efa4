"""Types of the ``_guarded`` C extension (``kernels/_guarded.c``): copies over engine memory
that may shrink, and one-call region copies; see :mod:`kvtier.kernels.guarded_copy`."""

from collections.abc import Sequence
from typing import Any, TypeAlias

from numpy.typing import NDArray
from typing_extensions import Buffer as _Bytes

Buffer: TypeAlias = _Bytes | NDArray[Any]

def copy_pages(
    dsts: Sequence[int],
    srcs: Sequence[int],
    length: int,
    stream: bool = ...,
    yield_bytes: int = ...,
    /,
) -> int:
    """``memcpy`` per page, stopping at a page that faults: the pages copied."""

def copy_strided(
    host: int,
    host_nbytes: int,
    offsets: Buffer,
    host_add: int,
    engine: int,
    engine_pages: int,
    page_ids: Buffer,
    stride: int,
    length: int,
    to_host: bool,
    stream: bool = ...,
    yield_bytes: int = ...,
    /,
) -> int:
    """One region's pages between the arena and an engine's memory: the pages copied."""

def copy_regions(
    host: int,
    host_nbytes: int,
    offsets: Buffer,
    page_ids: Buffer,
    table: Buffer,
    to_host: bool,
    stream: bool = ...,
    yield_bytes: int = ...,
    /,
) -> int:
    """Several regions' pages in one call: the pages copied."""
