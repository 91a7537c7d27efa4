"""Types of the ``_fileio`` C extension (``kernels/_fileio.c``): checksummed page I/O and
L3 object headers, each batch with the GIL released."""

from collections.abc import Sequence
from typing import Any, TypeAlias

from numpy.typing import NDArray
from typing_extensions import Buffer as _Bytes

Buffer: TypeAlias = _Bytes | NDArray[Any]

def write_pages(
    fd: int, buf: Buffer, offsets: Sequence[int], length: int, positions: Sequence[int], /
) -> list[int | None]:
    """Write each page to its file position: its xxh3-64, or None where the I/O failed."""

def read_pages(
    fd: int, buf: Buffer, offsets: Sequence[int], length: int, positions: Sequence[int], /
) -> list[int | None]:
    """Read each page from its file position: its xxh3-64, or None where the I/O failed."""

def checksum(buf: Buffer, /) -> int:
    """The xxh3-64 of ``buf``."""

def seal_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    pbuf: Buffer,
    payloads: Sequence[int],
    length: int,
    ns: Buffer,
    keys: Sequence[bytes],
    /,
) -> None:
    """Hash each payload and write its object header."""

def check_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    pbuf: Buffer,
    payloads: Sequence[int],
    length: int,
    ns: Buffer,
    keys: Sequence[bytes],
    /,
) -> list[bool]:
    """Whether each payload matches its object header."""

def write_headers(
    hbuf: Buffer,
    headers: Sequence[int],
    length: int,
    ns: Buffer,
    keys: Sequence[bytes],
    checksums: Sequence[int],
    /,
) -> None:
    """Write each object header recording the checksum given."""

def recorded_checksums(
    hbuf: Buffer, headers: Sequence[int], length: int, ns: Buffer, keys: Sequence[bytes], /
) -> list[int | None]:
    """The checksum each header records, or None for a header not of this key."""
