"""L3 backend on Redis or Valkey: one string value per page, shared by every daemon using it.

Each page is one key holding the self-describing object (96-byte header ‖ payload)::

    key    <prefix>:<namespace fingerprint hex>:<page key hex>
    value  header (magic, version, ns, key, length, xxh3 of payload, xxh3 of header) ‖ payload

Every batch is one pipeline, so one round trip: ``SET`` (with ``PX`` when ``ttl_s`` is set),
``GET`` (``GETEX PX`` with a TTL, so pages that keep being read keep living), one multi-key
``DEL``; the leading run is one ``EVALSHA`` of a five-line script (pipelined ``EXISTS`` where
scripting is disabled). Only plain commands are used, so Valkey and Redis-compatible servers
work too.

Commands are RESP-encoded here and written on a pooled redis-py connection; replies are
parsed by hiredis. This skips redis-py's per-command pipeline bookkeeping (tens of µs per
command) and lets each page's payload go to the socket as a view of the arena slot, right
after its header: a put copies nothing in Python.

Reads verify the header and the payload checksum before copying the payload into the arena
slot; a value that does not verify is a miss and counts in ``stats.corrupt``. Hashing and
copying large batches runs in a worker thread, so the event loop keeps answering.

Faults never raise into the daemon: a refused connection, a timeout or a server error makes
the batch a miss (``False`` / a run of 0), counts once in ``stats.errors`` and is logged on
the first failure after a healthy spell. redis-py reconnects on the next call, and a stale
pooled connection (the server restarted) is retried once, so the backend comes back by
itself when the server does.

Modules: :mod:`.options` (extra-config keys), :mod:`.resp` (command encoding, value
landing), :mod:`.backend` (the backend).
"""

from kvtier.daemon.storage.redis.backend import RedisBackend
from kvtier.daemon.storage.redis.options import RedisOptions

__all__ = ["RedisBackend", "RedisOptions"]
