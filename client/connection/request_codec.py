"""The LOOKUP, LOAD and STORE requests a connection sends: keys (and pages) packed, for
every length of list.

A LOOKUP of a 128K-token context carries 8,192 keys. As a MessagePack list that is 8,192
byte strings to encode, decode and hold as objects on both sides; packed (``packed_keys``,
:func:`kvtier.ipc.protocol.pack_keys`) it is one byte string, and the daemon answers it
from its key table without a Python object per key. A LOAD or STORE of as many pages also
carries 8,192 page indices: packed, they are one byte string of little-endian uint32
(``packed_pages``), checked by the daemon in numpy, and a LOAD's keys go to its key table
as they came. As lists, an 8,192-page LOAD's 16,384 objects cost the client and the daemon
milliseconds to build, encode, decode and check before the first byte is copied.

Every request goes in the packed form, one key or 8,192: one form on the wire, one way
through the daemon. Lists go only to a daemon that predates the packed form (whose
REGISTER reply lacks ``packed_lookup``, or ``packed_transfers`` for LOAD and STORE, and
which would read an empty ``keys``), and for items the packed form cannot carry (a key that
is not a bytes object of 32 bytes, a page that is not an integer in ``[0, 2**32)``): the
daemon refuses those naming the item, and the connection takes the refusal as a miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from kvtier.ipc import protocol as P
from kvtier.ipc.limits import KEY_BYTES

__all__ = ["key_list", "lookup_request", "transfer_request"]


def key_list(keys: Iterable[bytes] | np.ndarray) -> Sequence[bytes]:
    """``keys`` as a list or tuple of page keys (a list or tuple is returned as it is).

    A numpy array of fixed-width byte strings of :data:`~kvtier.ipc.limits.KEY_BYTES`
    (``np.array(keys)``) gives its keys whole: numpy reads each item with its trailing zero
    bytes cut, which would make such a key another (a miss). Another iterable is read into
    a list once (a generator is consumed here, not by whichever form is tried first).

    Raises:
        TypeError: a numpy array of another dtype or shape than ``S32``, 1-D.
    """
    if type(keys) is list or type(keys) is tuple:
        return keys
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1 or keys.dtype.kind != "S" or keys.dtype.itemsize != KEY_BYTES:
            raise TypeError(
                f"keys = a numpy array of dtype {keys.dtype} and shape {keys.shape}: page keys "
                f"as an array are 1-D of dtype S{KEY_BYTES}"
            )
        raw = np.ascontiguousarray(keys).tobytes()
        return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
    return list(keys)


def lookup_request(
    session_id: int, keys: Sequence[bytes], packed_ok: bool, count: int = 0
) -> P.Lookup:
    """The LOOKUP of ``keys`` for session ``session_id`` (``req_id`` is set when sent).

    Args:
        session_id: the session asking.
        keys: page keys in chain order.
        packed_ok: the daemon takes ``packed_keys`` (``Registered.packed_lookup``).
        count: a TP rank's count of its LOOKUPs, this one included (``round``; 0: none).

    Returns:
        A LOOKUP with ``packed_keys`` when allowed and every key is a bytes object of
        :data:`~kvtier.ipc.protocol.KEY_BYTES` bytes, whatever their number; else with
        ``keys``.
    """
    packed = P.pack_keys(keys) if packed_ok else None
    if packed is not None:
        return P.Lookup(
            req_id=0, session_id=session_id, packed_keys=memoryview(packed), round=count
        )
    return P.Lookup(req_id=0, session_id=session_id, keys=list(keys), round=count)


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
    deadline_ns: int = 0,
) -> P.Load | P.Store:
    """The LOAD or STORE (``kind``) of ``keys`` into or from engine ``pages``.

    Args:
        kind: :class:`~kvtier.ipc.protocol.Load` or :class:`~kvtier.ipc.protocol.Store`.
        session_id / slot / seq: as the request carries them.
        keys / pages: page keys in chain order, and the engine page of each (the daemon
            refuses counts that differ, in either form).
        packed_ok: the daemon takes ``packed_keys`` and ``packed_pages``
            (``Registered.packed_transfers``).
        parent_key: a STORE's key before ``keys[0]`` (None for a chain start).
        engine: a STORE's engine block hashes (:class:`~kvtier.ipc.protocol.EngineBlocks`).
        deadline_ns: when the caller stops waiting for the reply (``CLOCK_MONOTONIC`` ns; 0:
            never): a copy that would start later starts nothing.

    Returns:
        The request with ``packed_keys`` and ``packed_pages`` when allowed, every key is a
        bytes object of 32 bytes and every page a uint32, whatever their number; else with
        lists.
    """
    packed = P.pack_keys(keys) if packed_ok else None
    packed_pages = P.pack_pages(pages) if packed is not None else None
    body: dict[str, Any] = (
        {"packed_keys": memoryview(packed), "packed_pages": memoryview(packed_pages)}
        if packed is not None and packed_pages is not None
        # numpy integers as ints (msgspec encodes no numpy scalar); any other value goes as
        # it is, for the daemon to refuse naming ``pages``
        else {
            "keys": list(keys),
            "pages": [int(p) if isinstance(p, np.integer) else p for p in pages],
        }
    )
    if kind is P.Store:
        return P.Store(
            req_id=0,
            session_id=session_id,
            parent_key=parent_key,
            slot=slot,
            seq=seq,
            engine=engine,
            deadline_ns=deadline_ns,
            **body,
        )
    return P.Load(
        req_id=0, session_id=session_id, slot=slot, seq=seq, deadline_ns=deadline_ns, **body
    )
