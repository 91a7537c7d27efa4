"""Tenants: isolation by namespace, authentication at registration, quotas."""

from __future__ import annotations

import json

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection, DaemonError
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config, engine, fill_page, page_bytes, tokens
from tests.key_chain import spec_fingerprint, spec_page_keys

pytestmark = pytest.mark.timeout(120)

TOKEN_A = "tok-a-5f1e9c"
TOKEN_B = "tok-b-93d7aa"
ADMIN = "adm-4c2d1e"  # with tenants, only the admin token sees every tenant's data


def tenants(quota_a: int | None = None) -> str:
    """The ``--tenants`` JSON for tenants a and b."""
    a: dict[str, object] = {"token": TOKEN_A}
    if quota_a is not None:
        a["quota_pages"] = quota_a
    return json.dumps({"a": a, "b": {"token": TOKEN_B}})


def flush_own(conn: Connection, namespace: bytes = b"") -> P.FlushReply:
    """FLUSH through an engine session: what a tenant may drop (its own pages only).

    Connection has no public flush, so this goes through its session call.
    """
    return conn._session_call(
        lambda sid: P.Flush(req_id=0, session_id=sid, tier="l2", namespace=namespace.hex()),
        P.FlushReply,
    )


@pytest.fixture
def two_tenants(daemon_factory):
    """A daemon with tenants a and b; b stored 4 pages of the same tokens a will use."""
    d = daemon_factory("--tenants", tenants())
    pa, ca = engine(d.runtime_dir, model="m", tenant="a", token=TOKEN_A)
    pb, cb = engine(d.runtime_dir, model="m", tenant="b", token=TOKEN_B)
    try:
        toks = tokens(4 * SMALL.page_size)
        kb = spec_page_keys(
            spec_fingerprint(SMALL, model_id="m", tenant="b"), toks, SMALL.page_size
        )
        for p in range(4):
            fill_page(pb, p, seed=p + 30)
        h = cb.store(kb, [0, 1, 2, 3])
        assert h.count == 4 and h.wait()
        assert cb.lookup(kb).l2 == 4
        yield d, (pa, ca), (pb, cb), toks, kb
    finally:
        for c, p in ((ca, pa), (cb, pb)):
            c.close()
            p.close()


def test_same_tokens_in_two_tenants_never_meet(two_tenants):
    _, (_, ca), (_, cb), toks, kb = two_tenants
    # the tenant enters the namespace
    assert ca.ns_fingerprint == spec_fingerprint(SMALL, model_id="m", tenant="a")
    assert cb.ns_fingerprint == spec_fingerprint(SMALL, model_id="m", tenant="b")
    ka = spec_page_keys(ca.ns_fingerprint, toks, SMALL.page_size)
    assert set(ka).isdisjoint(kb)
    assert ca.lookup(ka).l2 == 0
    assert ca.load(ka, [10, 11, 12, 13]).count == 0
    # a's own pages work as usual (the checks above are not vacuous)
    h = ca.store(ka[:2], [0, 1])
    assert h.count == 2 and h.wait()
    assert ca.lookup(ka).l2 == 2
    assert cb.lookup(kb).l2 == 4


def test_sending_the_other_tenants_exact_keys_is_refused(two_tenants):
    _, (pa, ca), (pb, cb), toks, kb = two_tenants
    stolen = cb.page_keys(toks)  # exactly b's keys, computed as b computes them
    assert stolen == kb
    assert ca.lookup(stolen).l2 == 0
    h = ca.load(stolen, [20, 21, 22, 23])
    assert h.count == 0
    assert ca.lookup(stolen[:1]).l2 == 0
    # a store under b's keys makes pages of a's own namespace: b's pages are not touched,
    # and a later load by a returns a's bytes, never b's
    for p in range(4):
        fill_page(pa, p, seed=p + 900)
    mine = [page_bytes(pa, p) for p in range(4)]
    h = ca.store(stolen, [0, 1, 2, 3])
    assert (h.count, h.writing) == (4, 4) and h.wait()
    h = ca.load(stolen, [24, 25, 26, 27])
    assert h.count == 4 and h.wait()
    assert [page_bytes(pa, p) for p in range(24, 28)] == mine
    expected = [page_bytes(pb, p) for p in range(4)]
    h = cb.load(kb, [30, 31, 32, 33])
    assert h.count == 4 and h.wait()
    assert [page_bytes(pb, p) for p in range(30, 34)] == expected


def test_a_tenant_cannot_flush_another_tenants_pages(two_tenants):
    _, (_, ca), (_, cb), toks, kb = two_tenants
    ka = spec_page_keys(ca.ns_fingerprint, toks, SMALL.page_size)
    h = ca.store(ka[:2], [0, 1])
    assert h.count == 2 and h.wait()
    assert flush_own(ca, cb.ns_fingerprint).l2_pages == 0  # b's namespace, named exactly
    assert cb.lookup(kb).l2 == 4
    assert ca.lookup(ka).l2 == 2
    assert flush_own(ca).l2_pages == 2  # "everything": a's own pages only
    assert ca.lookup(ka).l2 == 0
    assert cb.lookup(kb).l2 == 4


def test_storing_the_other_tenants_keys_reveals_nothing(two_tenants):
    _, (_, ca), (_, cb), toks, _ = two_tenants
    # the fingerprint is computable from public facts: tenant name, model, geometry
    fp_b = spec_fingerprint(SMALL, model_id="m", tenant="b")
    assert fp_b == cb.ns_fingerprint
    held = spec_page_keys(fp_b, toks, SMALL.page_size)  # b has these
    fresh = spec_page_keys(fp_b, tokens(4 * SMALL.page_size, salt=77), SMALL.page_size)  # b has not
    h_held, h_fresh = ca.store(held[:1], [0]), ca.store(fresh[:1], [1])
    h_held.wait()
    h_fresh.wait()
    assert (h_held.count, h_held.writing) == (h_fresh.count, h_fresh.writing)


@pytest.mark.parametrize(
    "tenant,token",
    [
        ("a", "not-the-token"),
        ("a", ""),
        ("a", TOKEN_B),
        ("nobody", TOKEN_A),
        ("default", ""),
    ],
)
def test_wrong_or_missing_token_is_refused_at_registration_and_never_logged(
    daemon_factory, tenant, token
):
    d = daemon_factory("--tenants", tenants(), "--admin-token", ADMIN)
    pool = SharedKVPool(SMALL, 8)
    conn = Connection(
        pool,
        model_id="m",
        register=False,
        config=client_config(
            d.runtime_dir, tenant=tenant, token=token or None, request_timeout_s=10.0
        ),
    )
    try:
        with pytest.raises(DaemonError) as info:
            conn.register()
        assert info.value.code == P.ErrorCode.UNAUTHORIZED
        for secret in filter(None, (token, TOKEN_A, TOKEN_B)):
            assert secret not in str(info.value)
    finally:
        conn.close()
        pool.close()
    with AdminClient(d.endpoint, timeout_s=5.0, admin_token=ADMIN) as admin:
        assert admin.stats()["sessions"] == []
    log = d.log_path.read_text()
    assert "registration refused" in log
    for secret in filter(None, (token, TOKEN_A, TOKEN_B)):
        assert secret not in log


def _capacity_pages(d) -> int:
    """Slots the pool has for SMALL pages (one class uses every extent)."""
    with AdminClient(d.endpoint, timeout_s=5.0, admin_token=ADMIN) as admin:
        pool = admin.stats()["pool"]
    cls = next(c for c in pool["classes"] if c["page_bytes"] == SMALL.page_bytes)
    return int(cls["slots_per_extent"]) * int(pool["extents_total"])


def _store_chains(conn: Connection, chains: int, salt: int) -> list[list[bytes]]:
    """Store ``chains`` chains of 64 pages (engine pages 0..63 reused); return their keys."""
    out = []
    for i in range(chains):
        keys = conn.page_keys(tokens(64 * SMALL.page_size, salt=salt + i))
        h = conn.store(keys, list(range(64)))
        assert h.count == 64 and h.wait(), f"store of chain {i}: {h.count} of 64 accepted"
        out.append(keys)
    return out


@pytest.mark.parametrize("quota", [True, False], ids=["quota", "no-quota-control"])
def test_a_quota_stops_a_tenant_from_evicting_another(daemon_factory, quota):
    """b fills most of the pool; a stores three times its quota of 128 pages.

    A quota caps what a tenant holds; it reserves nothing. So b leaves room for a's
    quota, and the control (no quota) shows that a's stores do evict b's pages otherwise.
    """
    q = 128
    d = daemon_factory(
        "--hicache-size",
        "16MiB",
        "--tenants",
        tenants(q if quota else None),
        "--admin-token",
        ADMIN,
        name="q" if quota else "nq",
    )
    pa, ca = engine(d.runtime_dir, model="m", tenant="a", token=TOKEN_A)
    pb, cb = engine(d.runtime_dir, model="m", tenant="b", token=TOKEN_B)
    try:
        cap = _capacity_pages(d)
        b_chains = (cap - q - 64) // 64  # leaves between q + 64 and q + 127 slots free
        a_chains = 3 * q // 64
        assert 64 * a_chains > cap - 64 * b_chains  # a alone overflows the free room
        kb = _store_chains(cb, b_chains, salt=1000)
        assert [cb.lookup(k).l2 for k in kb] == [64] * b_chains
        ka = _store_chains(ca, a_chains, salt=2000)
        b_left = sum(cb.lookup(k).l2 for k in kb)
        a_left = sum(ca.lookup(k).l2 for k in ka)
        with AdminClient(d.endpoint, timeout_s=5.0, admin_token=ADMIN) as admin:
            evictions = admin.stats()["pool"]["evictions"]
        assert evictions > 0  # the pool was under pressure either way
        if quota:
            assert b_left == 64 * b_chains  # every one of b's pages remains
            assert 0 < a_left <= q
        else:
            assert b_left < 64 * b_chains
    finally:
        for c, p in ((ca, pa), (cb, pb)):
            c.close()
            p.close()
