"""LOAD and STORE with packed keys and pages, through a real kvtierd.

A connection sends every transfer packed (``packed_keys``, ``packed_pages``), one page or
thousands, to a daemon that says ``packed_transfers``
(:mod:`kvtier.client.connection.request_codec`). These tests hold the packed form to the
list form: the same pages stored and loaded (byte for byte, into the pages named), the
same partial runs, the same refusals (too many keys, a partial key, pages that do not
match the keys, a page outside the engine's memory or named twice, both forms at once),
and the daemon serving on after each refusal.
"""

from __future__ import annotations

import pytest
from kvtier.client.connection.replies import DaemonError
from kvtier.client.connection.request_codec import transfer_request
from kvtier.ipc import protocol as P
from kvtier.ipc.limits import KEY_BYTES

from tests.engines import engine, fill_page, page_bytes, tokens

PAGES = 512


def send(conn, **fields):
    """A LOAD with exactly ``fields`` (the client's own form choice bypassed); its reply."""
    return conn._session_call(
        lambda sid: P.Load(req_id=0, session_id=sid, slot=0, seq=1 << 40, **fields), P.LoadAccepted
    )


@pytest.fixture
def packed_engine(daemon_factory):
    d = daemon_factory("--max-keys-per-request", str(2 * PAGES))
    pool, conn = engine(d.runtime_dir, num_pages=2 * PAGES, model="packed")
    assert conn._packed_transfers, "this daemon takes packed transfers"
    keys = conn.page_keys(tokens(PAGES * pool.geometry.page_size))
    for p in range(PAGES):
        fill_page(pool, p, seed=p + 1)
    yield pool, conn, keys
    conn.close()
    pool.close()


def test_packed_store_and_load_move_the_same_bytes_as_lists(packed_engine) -> None:
    pool, conn, keys = packed_engine
    # the connection packs these (every key 32 bytes, every page a uint32)
    req = transfer_request(P.Store, conn.session_id, keys, list(range(PAGES)), 0, 1, True)
    assert req.packed_keys and req.packed_pages and not req.keys
    h = conn.store(keys, list(range(PAGES)))
    assert h.writing == PAGES and h.wait()
    assert conn.lookup(keys).l2 == PAGES
    # loaded packed into the second half, in reverse page order
    dest = list(range(2 * PAGES - 1, PAGES - 1, -1))
    h = conn.load(keys, dest)
    assert h.count == PAGES and h.wait()
    for i in range(PAGES):
        assert page_bytes(pool, dest[i]) == page_bytes(pool, i), f"key {i}"
    # a list-form LOAD of the same keys (the client told to send lists) loads the same
    conn._packed_transfers = False
    assert not transfer_request(P.Load, 1, keys, dest, 0, 1, False).packed_keys
    h = conn.load(keys[: PAGES // 2], list(range(PAGES, PAGES + PAGES // 2)))
    assert h.count == PAGES // 2 and h.wait()
    conn._packed_transfers = True
    for i in range(PAGES // 2):
        assert page_bytes(pool, PAGES + i) == page_bytes(pool, i)


def test_packed_load_stops_where_the_run_ends(packed_engine) -> None:
    pool, conn, keys = packed_engine
    half = PAGES // 2
    assert transfer_request(P.Store, 1, keys[:1], [0], 0, 1, True).packed_keys  # short: packed
    assert conn.store(keys[:half], list(range(half))).wait()
    assert conn.store(keys[half + 1 :], list(range(half + 1, PAGES))).wait()  # packed, a gap
    h = conn.load(keys, list(range(PAGES, 2 * PAGES)))
    assert h.count == half and h.wait()
    assert page_bytes(pool, PAGES + half - 1) == page_bytes(pool, half - 1)
    # a packed STORE of pages partly there writes only the missing ones
    h = conn.store(keys, list(range(PAGES)))
    assert h.count == PAGES and h.writing == 1 and h.wait()
    assert conn.load(keys, list(range(PAGES, 2 * PAGES))).count == PAGES


def test_packed_transfer_refusals_then_still_serving(packed_engine) -> None:
    pool, conn, keys = packed_engine
    assert conn.store(keys, list(range(PAGES))).wait()
    packed = b"".join(keys)
    pages = P.pack_pages(range(PAGES))
    assert pages is not None
    cases = [
        (
            {"packed_keys": packed + b"\0", "packed_pages": pages},
            P.ErrorCode.BAD_MESSAGE,
            "not a multiple of 32",
        ),
        (
            {"packed_keys": packed, "packed_pages": pages[:-1]},
            P.ErrorCode.BAD_MESSAGE,
            f"packed_pages has {4 * PAGES - 1} bytes; {PAGES} keys need {4 * PAGES}",
        ),
        (
            {"packed_keys": packed, "packed_pages": b""},
            P.ErrorCode.BAD_MESSAGE,
            "packed_pages has 0",
        ),
        (
            {"packed_keys": packed * 4 + keys[0], "packed_pages": pages * 4 + pages[:4]},
            P.ErrorCode.BAD_MESSAGE,
            "exceed max_keys_per_request",
        ),
        (
            {"packed_keys": packed, "packed_pages": P.pack_pages([*range(PAGES - 1), 2 * PAGES])},
            P.ErrorCode.OUT_OF_RANGE,
            f"packed_pages\\[{PAGES - 1}\\] = {2 * PAGES} is outside",
        ),
        (
            {"packed_keys": packed, "packed_pages": P.pack_pages([*range(PAGES - 1), 0xFFFFFFFF])},
            P.ErrorCode.OUT_OF_RANGE,
            f"= {0xFFFFFFFF} is outside",
        ),
        (
            {"packed_keys": packed, "packed_pages": P.pack_pages([*range(PAGES - 1), 3])},
            P.ErrorCode.BAD_MESSAGE,
            "same page twice",
        ),
        (
            {
                "keys": keys[:1],
                "pages": [0],
                "packed_keys": packed[KEY_BYTES:],
                "packed_pages": pages[4:],
            },
            P.ErrorCode.BAD_MESSAGE,
            "beside packed",
        ),
        (
            {"pages": [0], "packed_keys": packed[:KEY_BYTES]},
            P.ErrorCode.BAD_MESSAGE,
            "beside packed",
        ),
    ]
    for fields, code, message in cases:
        with pytest.raises(DaemonError, match=message) as err:
            send(conn, **fields)
        assert err.value.code == code, (fields.keys(), err.value)
    # a STORE is checked the same way
    with pytest.raises(DaemonError, match="same page twice"):
        conn._session_call(
            lambda sid: P.Store(
                req_id=0,
                session_id=sid,
                slot=0,
                seq=1 << 40,
                packed_keys=packed[:64],
                packed_pages=P.pack_pages([5, 5]),
            ),
            P.StoreAccepted,
        )
    # nothing was pinned or copied by the refusals: the pages load, packed, as before
    h = conn.load(keys, list(range(PAGES, 2 * PAGES)))
    assert h.count == PAGES and h.wait()
    assert page_bytes(pool, 2 * PAGES - 1) == page_bytes(pool, PAGES - 1)
    # an empty packed LOAD, and one of a single key, are answered like their lists
    rep = send(conn, packed_keys=b"", packed_pages=b"")
    assert isinstance(rep, P.LoadAccepted) and rep.count == 0
    rep = send(conn, packed_keys=keys[3], packed_pages=P.pack_pages([PAGES]))
    assert isinstance(rep, P.LoadAccepted) and rep.count == 1
    assert conn.lookup(keys).l2 == PAGES
