"""The default L3 backend, ``file``: a local disk store in preallocated segment files.

Not one file per page (creating and opening a file per 256 KiB page costs more than the
copy). Pages live in slots of a few large segment files, preallocated with
``posix_fallocate`` and created lazily up to the capacity; one segment serves one payload
slot size, several sizes coexist::

    <path>/kvtier-file.lock              flock'd while a process has the store open
    <path>/seg-<payload_slot>x<slots>-<seq>.kvt

    segment  ┌─────────────────────────────┬─────────────┬─────────────┬─────
             │ header table: 128 B / slot  │ payload 0   │ payload 1   │ ...
             │ (96-byte object headers)    │             │             │
             └─────────────────────────────┴─────────────┴─────────────┴─────
             0                  table_bytes (4 KiB aligned), payload_slot = round_up(len, 4 KiB)

Why the headers are apart from the payloads: a payload that starts 96 bytes into a page
straddles every page-cache page it touches, and the kernel's copies then cost markedly more
CPU than a raw ``pwrite``/``pread`` of the same bytes (``kvtier bench l3`` compares the two).
Aligned payloads copy like raw I/O, and the index rebuild reads one small table per
segment instead of one header per slot. The header is :mod:`~kvtier.daemon.storage.objects`'
self-describing header, unchanged.

A put batch writes straight from the arena, run by run of adjacent slots: (1) the run's
old headers zeroed, if any slot held an object before (one call), (2) each payload, its
checksum computed right after the copy while the bytes are hot in cache, (3) the run's new
headers (one call). A get reads a run's headers in one call, then each payload straight into
its arena slot, checksummed while hot. A batch is one worker-thread hop.

Crash safety: a header reaches the file only after its payload, and a reused slot loses its
old header before its payload is touched, so a killed process leaves each slot either
verifying or free. Torn writes on power loss are caught by the checksums: every read verifies
magic, version, namespace, key, length, header checksum and payload checksum; anything else
is a miss counted in ``stats.corrupt`` whose header is zeroed and whose slot is freed.

Durability (``fsync``): ``"never"`` leaves writes in the page cache, which survives a crash
of the daemon but not a power loss (pages written in the last seconds then read as misses,
never as wrong data). ``"batch"`` runs ``fdatasync`` on the touched segments before a put
batch reports success: durable, at a fraction of the write bandwidth.

Deletes zero the objects' headers and free their slots, which keep their disk blocks: the
next writes overwrite them at full speed, as they would a preallocated file. An operator's
FLUSH of L3 then calls ``release_space``, which punches every free slot's payload out of the
segment files (``fallocate`` hole punching), so a flush gives the disk space back but the
header tables. A punched slot is free like any other; writing it allocates its blocks again
(a full disk then fails that write, counted in ``stats.errors``, read as a miss). A reopen
does not fill the holes back in.

Index: an in-memory dict (namespace, key) -> slot record, rebuilt at open from the header
tables (a header is checked there; the payload when read). Eviction is LRU per payload slot
size, tail first: a put batch (a prefix chain k0..kn) enters and touches the LRU in reverse
order, so kn is evicted before k0. One lock guards the bookkeeping; I/O runs outside it.

Modules: :mod:`.segments` (the on-disk format), :mod:`.index` (the index and slot
allocator), :mod:`.batch_io` (reads and writes of runs of slots), :mod:`.gate` (worker
threads and close), :mod:`.config` (extra-config keys), :mod:`.backend` (the backend).
"""

from kvtier.daemon.storage.file.backend import FileBackend
from kvtier.daemon.storage.file.config import FileBackendConfig
from kvtier.daemon.storage.file.index import STRIPES
from kvtier.daemon.storage.file.segments import ALIGN, HEADER_STRIDE, payload_slot, table_bytes

__all__ = [
    "ALIGN",
    "HEADER_STRIDE",
    "STRIPES",
    "FileBackend",
    "FileBackendConfig",
    "payload_slot",
    "table_bytes",
]
