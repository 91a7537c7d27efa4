"""The LOOKUP request a connection sends: its keys packed when the list is long.

A LOOKUP of a 128K-token context carries 8,192 keys. As a MessagePack list that is 8,192
byte strings to encode, decode and hold as objects on both sides; packed (``packed_keys``,
:func:`kvtier.ipc.protocol.pack_keys`) it is one byte string, and the daemon answers it
from its key table without a Python object per key. Packed keys go only to a daemon whose
REGISTER reply said ``packed_lookup`` (an older one would read an empty ``keys``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.ipc import protocol as P

__all__ = ["PACKED_MIN_KEYS", "lookup_request"]

PACKED_MIN_KEYS = 256
"""Lists of this many keys or more are sent packed (shorter ones cost the same either way,
and the daemon probes them key by key)."""


def lookup_request(session_id: int, keys: Sequence[bytes], packed_ok: bool) -> P.Lookup:
    """The LOOKUP of ``keys`` for session ``session_id`` (``req_id`` is set when sent).

    Args:
        session_id: the session asking.
        keys: page keys in chain order.
        packed_ok: the daemon takes ``packed_keys`` (``Registered.packed_lookup``).

    Returns:
        A LOOKUP with ``packed_keys`` when allowed, long enough and every key is
        :data:`~kvtier.ipc.protocol.KEY_BYTES` long; else with ``keys``.
    """
    if packed_ok and len(keys) >= PACKED_MIN_KEYS:
        packed = P.pack_keys(keys)
        if packed is not None:
            return P.Lookup(req_id=0, session_id=session_id, packed_keys=packed)
    return P.Lookup(req_id=0, session_id=session_id, keys=list(keys))
