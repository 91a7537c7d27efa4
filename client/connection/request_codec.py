"""The LOOKUP, LOAD and STORE requests a connection sends: keys (and pages) packed when
the list is long.

A LOOKUP of a 128K-token context carries 8,192 keys. As a MessagePack list that is 8,192
byte strings to encode, decode and hold as objects on both sides; packed (``packed_keys``,
:func:`kvtier.ipc.protocol.pack_keys`) it is one byte string, and the daemon answers it
from its key table without a Python object per key. Packed keys go only to a daemon whose
REGISTER reply said ``packed_lookup`` (an older one would read an empty ``keys``).

A LOAD or STORE of as many pages also carries 8,192 page indices: packed, they are one
byte string of little-endian uint32 (``packed_pages``), checked by the daemon in numpy,
and a LOAD's keys go to its key table as they came. Sent only to a daemon that said
``packed_transfers``. As lists, an 8,192-page LOAD's 16,384 objects cost the client and
the daemon milliseconds to build, encode, decode and check before the first byte is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.ipc import protocol as P

__all__ = ["PACKED_MIN_KEYS", "lookup_request", "transfer_request"]

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
            return P.Lookup(req_id=0, session_id=session_id, packed_keys=memoryview(packed))
    return P.Lookup(req_id=0, session_id=session_id, keys=list(keys))


def transfer_request(
    kind: type[P.Load | P.Store],
    session_id: int,
    keys: Sequence[bytes],
    pages: Sequence[int],
    slot: int,
    seq: int,
    packed_ok: bool,
    parent_key: bytes | None = None,
    engine: P.EngineBlocks | None = None,
) -> P.Load | P.Store:
    """The LOAD or STORE (``kind``) of ``keys`` into or from engine ``pages``.

    Args:
        kind: :class:`~kvtier.ipc.protocol.Load` or :class:`~kvtier.ipc.protocol.Store`.
        session_id / slot / seq: as the request carries them.
        keys / pages: page keys in chain order, and the engine page of each.
        packed_ok: the daemon takes ``packed_keys`` and ``packed_pages``
            (``Registered.packed_transfers``).
        parent_key: a STORE's key before ``keys[0]`` (None for a chain start).
        engine: a STORE's engine block hashes (:class:`~kvtier.ipc.protocol.EngineBlocks`).

    Returns:
        The request, packed when allowed, at least :data:`PACKED_MIN_KEYS` long, every
        key 32 bytes and every page a uint32 with one page per key; else with lists.
    """
    if packed_ok and len(keys) >= PACKED_MIN_KEYS and len(pages) == len(keys):
        packed = P.pack_keys(keys)
        packed_pages = P.pack_pages(pages) if packed is not None else None
        if packed is not None and packed_pages is not None:
            packed_keys = memoryview(packed)
            if kind is P.Store:
                return P.Store(
                    req_id=0,
                    session_id=session_id,
                    packed_keys=packed_keys,
                    packed_pages=memoryview(packed_pages),
                    parent_key=parent_key,
                    slot=slot,
                    seq=seq,
                    engine=engine,
                )
            return P.Load(
                req_id=0,
                session_id=session_id,
                packed_keys=packed_keys,
                packed_pages=memoryview(packed_pages),
                slot=slot,
                seq=seq,
            )
    if kind is P.Store:
        return P.Store(
            req_id=0,
            session_id=session_id,
            keys=list(keys),
            pages=list(pages),
            parent_key=parent_key,
            slot=slot,
            seq=seq,
            engine=engine,
        )
    return P.Load(
        req_id=0, session_id=session_id, keys=list(keys), pages=list(pages), slot=slot, seq=seq
    )
