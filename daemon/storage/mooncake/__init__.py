"""L3 backend on Mooncake Store: pages move zero-copy between the arena and the cluster's segments.

One page is ONE Mooncake object: its 96-byte header, then its payload::

    object <prefix>:<ns hex>:<key hex>  =  header (96 B)  ‖  payload (length B)

When the arena gives every slot headroom (``HostArena.headroom >= 96``: kvtierd's host pool
does when this backend is configured), the header is written into the slot's own headroom,
right before the payload, and the page moves as ONE contiguous registered buffer::

    arena   ... | headroom ... | header | payload (offset .. offset + length) | ...
                               ^ offset - 96: one buffer of 96 + length bytes

    put: header into arena[offset - 96 : offset] → batch_put_from(keys, [ptr], [96 + length])
    get: batch_get_into(keys, [ptr], [96 + length]) → check header, xxh3 of the payload

Without headroom (or when one batch names a slot twice) the header goes to a registered
scratch slot and the object is assembled from two buffers in one transfer
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` with ``[[hdr, slot]]``).
The object's bytes are the same either way, so a store written by one path reads with the
other. One buffer is worth the headroom over TCP: there every buffer is a separate
acknowledged request, so a separate header costs a round trip per page.

Why one object rather than two (``<key>.h`` and ``<key>``): it is one key per page in the
master (half the metadata and lookups), the header and payload are written and evicted
together (a store that evicts silently can never leave a header without its payload or
pair an old header with a new payload), and it costs no copy: the payload is read from and
written to the arena slot directly.

A batch is one job (batches beyond ``sub_batch_keys`` are split into concurrent jobs), run in
the backend's own pool of ``max_inflight`` threads, never on the event loop. A job seals (put)
or checks (get) all its headers in one call of :func:`~kvtier.daemon.storage.objects.seal_headers`
/ :func:`~kvtier.daemon.storage.objects.check_headers`, which hash with the GIL released, so
hashing in one worker does not stall the event loop or the other workers. Mooncake's batch
calls busy-poll their calling thread until the transfer is done, so the workers run at a
lower priority (``worker_nice``): on a node whose cores are all busy the poll then gives way
to the threads that move the bytes.

Store semantics this relies on (Mooncake 0.3.13): ``put`` of an existing key keeps the old
object and reports success, which is right for content-named pages; a full store evicts
old objects silently, so not-found is an ordinary miss. An object that does not verify is
removed (force) so that the next put can write a good one.

Return codes: a get answers the bytes read, ``-704`` (not found), ``-703`` (replica not
ready) or ``-707`` (lease expired) for a miss, ``-600`` / ``-800`` when the object's size
differs from the buffers (counted corrupt), other negatives for faults (``-900`` the master
is unreachable). A put answers 0, ``-705`` (already there, success), ``-200`` (no space,
a shortfall, not an error) or a fault.

Modules: :mod:`.options` (extra-config keys), :mod:`.codes` (Mooncake's return codes),
:mod:`.connect` (reachability and setup), :mod:`.scratch` (registered header memory),
:mod:`.workers` (the worker threads), :mod:`.jobs` (what a worker runs), :mod:`.backend`.
"""

from kvtier.daemon.storage.mooncake.backend import MooncakeBackend
from kvtier.daemon.storage.mooncake.options import MooncakeOptions

__all__ = ["MooncakeBackend", "MooncakeOptions"]
