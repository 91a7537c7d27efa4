"""Types of the ``_keyprobe`` C extension (``daemon/pool/native/_keyprobe.c``): the host pool's key
table probe, an adopted pool's key index and row seals."""

from typing import Any, TypeAlias

from numpy.typing import NDArray
from typing_extensions import Buffer as _Bytes

Buffer: TypeAlias = _Bytes | NDArray[Any]

def leading_run(
    table: Buffer,
    keys: Buffer,
    ns: Buffer,
    state: Buffer,
    key_len: Buffer,
    words: Buffer,
    ns_id: int,
    mult0: int,
    mult1: int,
    shift: int,
    start: int,
    max_rounds: int,
    ready: int,
    slots: Buffer = ...,
    /,
) -> tuple[int, int]:
    """The leading run of the packed ``words`` found from ``start`` on: ``(the index it
    stopped at, whether a key was left unresolved)``."""

def index_keys(rows: Buffer, slots: Buffer, by_slot: list[bytes | None]) -> dict[bytes, int]:
    """Key → slot for ``rows``; raises ValueError for a key twice (``by_slot`` unchanged)."""

def seals(rows: Buffer, lengths: Buffer, seeds: Buffer, out: Buffer) -> None:
    """Each row's seal into ``out``."""
