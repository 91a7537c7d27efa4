"""Types of the ``_keyprobe`` C extension (``daemon/pool/native/_keyprobe.c``): the host pool's key
table's insertions and probe, an adopted pool's key index and row seals."""

from collections.abc import Sequence
from typing import Any, TypeAlias

from numpy.typing import NDArray
from typing_extensions import Buffer as _Bytes

Buffer: TypeAlias = _Bytes | NDArray[Any]

class Probe:
    """The key table's insertions and probes over its table and the pool's columns."""

    def __init__(
        self,
        table: Buffer,
        keys: Buffer,
        ns: Buffer,
        state: Buffer,
        key_len: Buffer,
        mult0: int,
        mult1: int,
        shift: int,
        max_rounds: int,
        ready: int,
        /,
    ) -> None: ...
    def add(self, slots: Buffer | Sequence[int], /) -> int:
        """Enter ``slots``; returns how many found no empty entry near their bucket."""
    def leading_run(
        self,
        words: Buffer,
        ns_id: int,
        start: int,
        slots: list[int] | None = ...,
        lengths: Buffer | None = ...,
        /,
    ) -> tuple[int, int]:
        """The leading run of the packed ``words`` found from ``start`` on: ``(the index it
        stopped at, whether a key was left unresolved)``."""
    def close(self) -> None:
        """Release the buffers."""

def index_keys(
    rows: Buffer, lengths: Buffer, slots: Buffer, by_slot: list[bytes | None], /
) -> dict[bytes, int]:
    """Key (each row's first ``lengths[i]`` bytes) → slot; raises ValueError for a key twice
    (``by_slot`` unchanged)."""

def seals(rows: Buffer, lengths: Buffer, seeds: Buffer, out: Buffer, /) -> None:
    """Each row's seal (XXH3-64 of its first ``lengths[i]`` bytes, 0 to 32) into ``out``."""
