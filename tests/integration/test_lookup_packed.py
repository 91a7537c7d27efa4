"""LOOKUP with packed keys, through a real kvtierd: the same answers as a key list, for any list.

The daemon answers a packed LOOKUP from its key table; these tests hold it to the
list form's answer (the leading run of the keys present in the session's namespace) for
chains, lists that are no chain, duplicates, another namespace's keys and absent keys,
and to the list form's refusals: too many keys, a partial key, both forms at once.
"""

from __future__ import annotations

import random

import pytest
from kvtier.client.connection.replies import DaemonError
from kvtier.client.connection.request_codec import lookup_request
from kvtier.ipc import protocol as P
from kvtier.ipc.limits import KEY_BYTES, MAX_KEYS

from tests.engines import SMALL, engine, tokens

PAGES = 512


def ask(conn, **fields) -> P.LookupResult:
    """A LOOKUP with exactly ``fields`` as keys (the client's own form choice bypassed)."""
    return conn._session_call(
        lambda sid: P.Lookup(req_id=0, session_id=sid, **fields), P.LookupResult
    )


def both(conn, keys: list[bytes]) -> int:
    """The L2 run of ``keys``, asked packed and as a list: the answers must agree."""
    packed = ask(conn, packed_keys=b"".join(keys)).l2
    assert ask(conn, keys=keys).l2 == packed
    return packed


@pytest.fixture
def two_engines(daemon_factory):
    d = daemon_factory("--max-keys-per-request", str(4 * PAGES))
    a_pool, a = engine(d.runtime_dir, num_pages=PAGES, model="a")
    b_pool, b = engine(d.runtime_dir, num_pages=PAGES, model="b")
    a_keys = a.page_keys(tokens(PAGES * SMALL.page_size))
    b_keys = b.page_keys(tokens(PAGES * SMALL.page_size, salt=3))
    assert a.store(a_keys, list(range(PAGES))).wait()
    assert b.store(b_keys, list(range(PAGES))).wait()
    yield a, b, a_keys, b_keys
    for closing in (a, b, a_pool, b_pool):
        closing.close()


def test_packed_lookup_matches_the_list_for_any_list(two_engines) -> None:
    a, b, a_keys, b_keys = two_engines
    rng = random.Random(11)
    absent = [rng.randbytes(KEY_BYTES) for _ in range(PAGES)]
    assert both(a, a_keys) == PAGES
    assert both(a, a_keys[:100] + absent[:1] + a_keys[100:]) == 100
    shuffled = a_keys[:]
    rng.shuffle(shuffled)
    assert both(a, shuffled) == PAGES  # present, in no chain order
    assert both(a, [a_keys[7]] * (2 * PAGES)) == 2 * PAGES  # duplicates
    assert both(a, b_keys) == 0  # the other engine's namespace is not seen
    assert both(a, a_keys[:300] + b_keys) == 300
    assert both(b, b_keys + a_keys) == PAGES
    assert both(a, absent + a_keys) == 0
    # the client sends every list packed, however short, and gets the same answers
    for n in (1, 2, PAGES):
        req = lookup_request(a.session_id, a_keys[:n], True)
        assert bytes(req.packed_keys) == b"".join(a_keys[:n]) and not req.keys
        assert a.lookup(a_keys[:n]).l2 == n
    assert a.lookup(absent[:1] + a_keys[:1]).l2 == 0
    assert a.lookup(a_keys[: PAGES - 1] + absent[:1]).l2 == PAGES - 1


def test_packed_lookup_refusals_then_still_serving(two_engines) -> None:
    a, _, a_keys, _ = two_engines
    limit = 4 * PAGES
    assert ask(a, packed_keys=b"".join(a_keys * 4)).l2 == limit  # at the limit: answered
    with pytest.raises(DaemonError, match="exceed max_keys_per_request") as err:
        ask(a, packed_keys=b"".join(a_keys * 4 + a_keys[:1]))
    assert err.value.code == P.ErrorCode.BAD_MESSAGE
    with pytest.raises(DaemonError, match="not a multiple of 32"):
        ask(a, packed_keys=b"".join(a_keys) + b"\0")
    with pytest.raises(DaemonError, match="both given"):
        ask(a, keys=a_keys[:1], packed_keys=b"".join(a_keys[1:]))
    with pytest.raises(DaemonError, match="packed_keys"):  # past the wire bound: refused at decode
        ask(a, packed_keys=bytes(KEY_BYTES * (MAX_KEYS + 1)))
    assert a.lookup(a_keys).l2 == PAGES
    assert ask(a, packed_keys=b"").l2 == 0
