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

class CopyPool:
    """The queue of the copy threads: region copies run in C, Python jobs handed out."""

    fd: int
    def __init__(self) -> None: ...
    def submit_copy(
        self,
        id: int,
        user: int,
        host: int,
        host_nbytes: int,
        offsets: Buffer,
        page_ids: Buffer,
        table: Buffer,
        groups: Buffer,
        to_host: bool,
        stream: bool,
        yield_bytes: int,
        layers_addr: int,
        wake_addr: int,
        num_layers: int,
        /,
    ) -> None:
        """Queue a region copy (every row and index checked first)."""
    def submit_call(self, id: int, user: int, /) -> None:
        """Queue a Python job; :meth:`serve` hands its id to a thread."""
    def serve(self) -> int | None:
        """Run region copies until a Python job is due (its id) or the pool ends (None)."""
    def reap(self) -> list[tuple[int, int, int]]:
        """The region copies that ended: (id, status, pages)."""
    def cancel(self, id: int, /) -> bool:
        """Stop a queued or running region copy before its next group."""
    def queued(self) -> dict[int, int]:
        """Jobs waiting, per user."""
    def ended(self) -> int:
        """Region copies that ended and were not reaped yet."""
    def shutdown(self, cancel: bool = ..., /) -> list[int]:
        """Take no more jobs; with ``cancel``, drop the queued ones (the Python jobs' ids)."""
