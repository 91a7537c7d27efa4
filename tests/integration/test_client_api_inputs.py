"""The engine-side client's public API called with the inputs an engine author may plausibly
pass: out-of-range layers, odd timeouts, token ids of another type, extreme settings.

Every test runs a real kvtierd (``daemon_factory``) and the real
:class:`~kvtier.client.connection.connection.Connection` over a real
:class:`~kvtier.client.kv_pool.shared.SharedKVPool`. What a user expects: a clear error
naming the argument (or a documented miss), no change to what the daemon holds, no hang,
and no call that turns a good transfer or a healthy daemon into a miss for what follows.
"""

from __future__ import annotations

import math
import os
import signal
import threading

import numpy as np
import pytest
import torch
from kvtier.client.connection.admin import AdminClient, AdminError
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P
from kvtier.ipc.shm import SharedMemoryError

from tests.engines import SMALL, client_config, engine, fill_page, page_bytes, tokens

BIG = P.Geometry(num_layers=16, page_size=16, kv_heads=8, head_dim=128, dtype="float16")
"""1 MiB pages: a 32-page LOAD runs long enough to be caught in the middle by SIGSTOP."""


def stored(conn: Connection, pool: SharedKVPool, n: int, salt: int) -> list[bytes]:
    """Fill engine pages ``0..n-1``, store them under a fresh chain; the keys."""
    for p in range(n):
        fill_page(pool, p, salt * 100 + p)
    keys = conn.page_keys(tokens(n * conn.geometry.page_size, salt=salt))
    assert len(keys) == n
    assert conn.store(keys, list(range(n))).wait(), "the setup STORE failed"
    assert conn.lookup(keys).l2 == n
    return keys


def load_caught_mid_copy(d, conn: Connection, keys: list[bytes], pages: list[int]):
    """A LOAD of ``keys`` into ``pages`` with the daemon SIGSTOPped while it copies (the
    caller SIGCONTs it). None when no try caught it in the middle."""
    for _ in range(30):
        h = conn.load(keys, pages)
        assert h.count == len(keys)
        os.kill(d.pid, signal.SIGSTOP)
        if h.copying() and h.layers_ready() < h.num_layers:
            return h
        os.kill(d.pid, signal.SIGCONT)
        assert h.wait()
    return None


# ---------------------------------------------------------------------------- claim


@pytest.mark.timeout(120)
def test_a_claim_with_a_zero_timeout_leaves_later_lookups_and_loads_served(daemon_factory):
    """``claim(keys, timeout=...)`` bounds how long *that* claim waits for its reply. A
    scheduler that claims without waiting (``timeout=0``) may get 0 (a miss) for it, but the
    daemon is up and answering: the next ``lookup`` of the same keys still reports the pages
    L2 holds, a ``load`` of them still runs, and ``stats()`` still answers. Nothing about
    the daemon's health is inferred from a caller's own zero deadline."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, request_timeout_s=3.0)
    try:
        keys = stored(conn, pool, 4, salt=1)
        conn.claim(keys, timeout=0.0)
        after = conn.lookup(keys)
        assert after.l2 == 4, (
            f"lookup right after claim(timeout=0) reported {after} for 4 pages L2 holds"
        )
        h = conn.load(keys, [10, 11, 12, 13])
        assert h.count == 4 and h.wait(), f"load after the claim: count {h.count}"
        conn.stats()  # raises DaemonUnavailable when the connection thinks the daemon is down
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_a_claim_with_a_nan_timeout_is_refused_naming_it(daemon_factory):
    """``claim(keys, timeout=nan)`` is no duration: it is refused with a ValueError that
    names ``timeout`` before anything is sent, and the pages L2 holds stay served."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir)
    try:
        keys = stored(conn, pool, 2, salt=2)
        with pytest.raises(ValueError, match="timeout"):
            conn.claim(keys, timeout=math.nan)
        assert conn.lookup(keys).l2 == 2
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- handles


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layer", [4, 99])
def test_wait_layer_past_the_last_layer_is_refused_and_the_load_stays_good(daemon_factory, layer):
    """``handle.wait_layer(i)`` takes a layer index in ``[0, num_layers)``. An index past
    the last layer (an off-by-one: ``wait_layer(num_layers)``) is a caller's mistake: it
    raises a ValueError/IndexError naming the layer, and the load itself, which copied every
    page, still reports success (``wait()`` True, ``ok``) with the right bytes."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, load_timeout_s=2.0)
    try:
        keys = stored(conn, pool, 4, salt=3)
        h = conn.load(keys, [10, 11, 12, 13])
        assert h.count == 4 and h.num_layers == SMALL.num_layers == 4
        with pytest.raises((ValueError, IndexError)):
            h.wait_layer(layer)
        assert h.wait(), "a load whose every page was copied reports failure"
        assert h.ok
        for i in range(4):
            assert page_bytes(pool, 10 + i) == page_bytes(pool, i)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
def test_wait_layer_of_a_negative_layer_never_reports_pages_that_are_not_there(daemon_factory):
    """``wait_layer(-1)`` (a negative index, as Python reads "the last layer") raises an
    IndexError naming the layer; it never returns True ("the layer is in place, read it")
    while the daemon has copied nothing: the engine would compute on pages that hold other
    KV."""
    d = daemon_factory("--hicache-size", "160MiB")
    pool, conn = engine(d.runtime_dir, geometry=BIG, num_pages=64, load_timeout_s=1.0)
    stopped = False
    try:
        keys = stored(conn, pool, 32, salt=4)
        h = load_caught_mid_copy(d, conn, keys, list(range(32, 64)))
        assert h is not None, "never caught a LOAD in the middle of its copy"
        stopped = True
        with pytest.raises(IndexError, match="layer"):
            h.wait_layer(-1, timeout=0.5)
    finally:
        if stopped:
            os.kill(d.pid, signal.SIGCONT)
        conn.close()
        pool.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", ["wait_layer", "wait"])
def test_a_nan_timeout_on_a_stalled_transfer_does_not_wait_forever(daemon_factory, call):
    """A wait with ``timeout=nan`` on a transfer the daemon stalls in (SIGSTOP) is refused
    at once with a ValueError naming ``timeout``; it never spins until the daemon happens to
    resume."""
    d = daemon_factory("--hicache-size", "160MiB")
    pool, conn = engine(d.runtime_dir, geometry=BIG, num_pages=64, load_timeout_s=1.0)
    stopped = False
    try:
        keys = stored(conn, pool, 32, salt=5)
        h = load_caught_mid_copy(d, conn, keys, list(range(32, 64)))
        assert h is not None, "never caught a LOAD in the middle of its copy"
        stopped = True
        result: dict[str, object] = {}

        def wait() -> None:
            try:
                if call == "wait":
                    result["got"] = h.wait(timeout=math.nan)
                else:
                    result["got"] = h.wait_layer(h.num_layers - 1, timeout=math.nan)
            except ValueError as err:
                result["got"] = err

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        t.join(8.0)
        assert not t.is_alive(), (
            f"{call}(timeout=nan) still waiting 8 s after it began, with load_timeout_s "
            f"{conn.config.load_timeout_s}s, on a stalled daemon"
        )
        assert isinstance(result.get("got"), ValueError), result
        assert "timeout" in str(result["got"])
    finally:
        if stopped:
            os.kill(d.pid, signal.SIGCONT)
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- page keys


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "form",
    ["list", "numpy", "torch"],
)
def test_page_keys_of_non_integral_token_ids_never_equal_other_tokens_keys(daemon_factory, form):
    """Page keys name a page's exact token ids (docs: "a SHA-256 chain over full pages of
    tokens"). Token ids that are not integers (1.5, as floats in a list, a float64 array or
    a float tensor) are refused with a ValueError/TypeError; they never get the keys of
    other tokens (1), which would make a lookup serve another prompt's KV."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir)
    try:
        n = SMALL.page_size
        floats = {
            "list": [1.5] * n,
            "numpy": np.full(n, 1.5),
            "torch": torch.full((n,), 1.5),
        }[form]
        try:
            got = conn.page_keys(floats)
        except (ValueError, TypeError):
            return
        assert got != conn.page_keys([1] * n), (
            f"page_keys of {n} tokens 1.5 ({form}) equal the keys of {n} tokens 1"
        )
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- settings


@pytest.mark.timeout(120)
def test_a_long_request_timeout_the_config_accepts_lets_the_connection_register(
    daemon_factory,
):
    """``ClientConfig(request_timeout_s=...)`` accepts any positive finite number; one a
    cautious operator picks to mean "practically never give up" (30 days) must then work:
    the connection registers and serves lookups (or the config refuses the value, naming
    ``request_timeout_s``), never an OverflowError from inside ZeroMQ."""
    d = daemon_factory()
    try:
        cfg = client_config(d.runtime_dir, request_timeout_s=30 * 86400.0)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        assert "request_timeout_s" in str(err)
        return
    pool = SharedKVPool(SMALL, 8)
    try:
        with Connection(pool, model_id="m", config=cfg) as conn:
            keys = conn.page_keys(tokens(32, salt=6))
            assert conn.lookup(keys).l2 == 0
            assert conn.session_id != 0
    finally:
        pool.close()


# ---------------------------------------------------------------------------- more inputs


@pytest.mark.timeout(60)
def test_a_parent_that_is_not_a_page_key_is_refused_naming_it(daemon_factory):
    """``page_keys(tokens, parent=...)`` continues a chain from the key of the page before
    ``tokens``: anything but a 32-byte key (a truncated key, an empty one, a string) is
    refused naming ``parent``; ``None`` starts from the namespace."""
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir)
    try:
        toks = tokens(2 * SMALL.page_size, salt=7)
        first = conn.page_keys(toks)
        assert conn.page_keys(toks, None) == first
        assert conn.page_keys(toks[SMALL.page_size :], first[0]) == first[1:]
        for bad in (b"", b"x", first[0][:31], first[0] + b"\x00", "k" * 32):
            with pytest.raises(ValueError, match="parent"):
                conn.page_keys(toks, bad)  # type: ignore[arg-type]
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_an_admin_client_used_after_close_says_it_is_closed(daemon_factory):
    """A closed :class:`AdminClient` raises its own error (AdminError), as every failure of
    an admin call does, not ZeroMQ's."""
    d = daemon_factory()
    admin = AdminClient(d.endpoint, timeout_s=5.0)
    assert admin.health().status == "ok"
    admin.close()
    with pytest.raises(AdminError, match="closed"):
        admin.health()


def test_a_kv_pool_of_a_size_that_is_no_page_count_or_past_memory_is_refused():
    """``SharedKVPool(geometry, num_pages)``: a count that is not an integer (``True``,
    ``1.5``), out of ``[1, 2**26]``, or larger than the memory available is refused before
    anything is reserved (reserving it would have the kernel kill a process)."""
    for bad, kind in ((True, TypeError), (1.5, TypeError), (0, ValueError), (2**27, ValueError)):
        with pytest.raises(kind, match="num_pages"):
            SharedKVPool(SMALL, bad)  # type: ignore[arg-type]
    huge = P.Geometry(num_layers=64, page_size=1024, kv_heads=64, head_dim=256, dtype="float32")
    with pytest.raises(SharedMemoryError, match="memory available"):
        SharedKVPool(huge, 1 << 20)  # 64 GiB per layer and part
    pool = SharedKVPool(SMALL, np.int64(2))
    try:
        assert pool.num_pages == 2
    finally:
        pool.close()


def test_keys_as_a_numpy_array_are_the_same_keys(daemon_factory):
    """``np.array(keys)`` is a natural way to hold a chain's keys. numpy reads an item of such
    an array with its trailing zero bytes cut, so a key ending in a zero byte would be
    another key (a miss), and an empty check of an array raises numpy's "truth value of an
    array" error. The keys of an ``S32`` array are taken whole by LOOKUP, LOAD, STORE,
    PREFETCH and CLAIM; an array of another dtype is refused naming it."""
    d = daemon_factory()
    p, c = engine(d.runtime_dir)
    try:
        salt = next(s for s in range(1, 5000) if c.page_keys(tokens(4 * 16, salt=s))[-1][-1] == 0)
        keys = c.page_keys(tokens(4 * 16, salt=salt))
        arr = np.array(keys)
        assert len(arr[-1]) < 32  # what numpy gives for the last key
        for i in range(4):
            fill_page(p, i, 100 + i)
        h = c.store(arr, [0, 1, 2, 3])
        assert h.count == 4 and h.wait()
        assert c.lookup(arr).l2 == 4
        h = c.load(arr, [4, 5, 6, 7])
        assert h.count == 4 and h.wait()
        for i in range(4):
            assert page_bytes(p, 4 + i) == page_bytes(p, i)
        assert c.lookup(np.array([], dtype="S32")).l2 == 0
        with pytest.raises(TypeError, match="dtype"):
            c.lookup(np.array([k.hex() for k in keys]))
    finally:
        c.close()
        p.close()
