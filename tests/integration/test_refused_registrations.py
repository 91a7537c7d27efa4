"""Registrations kvtierd refuses, as after a restart that removed a tenant whose engines
keep running (real kvtierd, real engines): they hold nothing on the daemon and never lock
the remaining tenants out."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
from kvtier.client.connection.admin import AdminClient

from tests.engines import engine, tokens

ADMIN = "adm-review-7c41e2"


def tenants_json(names: str) -> str:
    return json.dumps({n: {"token": f"tok-{n}-5a9e31"} for n in names})


def waiting_handovers(d) -> int:
    with AdminClient(d.endpoint, timeout_s=5.0, admin_token=ADMIN) as admin:
        users = admin.stats()["limits"]["users"]
    return max((int(u.get("handovers_waiting", 0)) for u in users.values()), default=0)


@pytest.mark.timeout(150)
def test_engines_of_a_removed_tenant_never_lock_the_remaining_tenants_out(daemon_factory):
    """kvtierd is restarted with tenants ``b``, ``c`` and ``d`` removed from its
    configuration (``systemctl restart`` after editing ``tenants``); their engines, run by the
    same service user as tenant ``a``'s, keep serving requests (each one a miss: their
    registration is refused). Tenant ``a`` is still configured: a new engine of ``a``
    started now registers and finds ``a``'s adopted pages. A refused registration holds
    nothing on the daemon (its handed-over memory is released), so the refused engines'
    retries can never use up the user's handover bounds and keep ``a``'s engines out."""
    d = daemon_factory("--admin-token", ADMIN, "--tenants", tenants_json("abcd"))
    engines = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        pa, ca = engine(d.runtime_dir, tenant="a", token="tok-a-5a9e31", num_pages=16)
        engines.append((pa, ca))
        keys = ca.page_keys(tokens(4 * 16, salt=1))
        h = ca.store(keys, [0, 1, 2, 3])
        assert h.count == 4 and h.wait()
        stale = []
        for t in "bcd":
            p, c = engine(d.runtime_dir, tenant=t, token=f"tok-{t}-5a9e31", num_pages=16)
            engines.append((p, c))
            stale.append(c)
        assert d.stop() == 0
        d = daemon_factory("--admin-token", ADMIN, "--tenants", tenants_json("a"))

        def serve(conn) -> None:  # an engine of a removed tenant keeps serving requests
            while not stop.is_set():
                assert conn.lookup(keys).l2 == 0

        threads = [threading.Thread(target=serve, args=(c,), daemon=True) for c in stale]
        for t in threads:
            t.start()
        seen = []
        for _ in range(15):  # 3 s of refused retries, each of them a handover made
            time.sleep(0.2)
            seen.append(waiting_handovers(d))
        # at most one handover per refused engine is ever between its making and its REGISTER
        assert max(seen) <= len(stale), seen
        try:
            p2, c2 = engine(d.runtime_dir, tenant="a", token="tok-a-5a9e31", num_pages=16)
        except Exception as err:
            pytest.fail(
                f"a new engine of the configured tenant a could not register: {err!r}; "
                f"handovers waiting: {waiting_handovers(d)}"
            )
        engines.append((p2, c2))
        assert c2.lookup(keys).l2 == 4
    finally:
        stop.set()
        for t in threads:
            t.join(15)
        for p, c in engines:
            c.close()
            p.close()


@pytest.mark.timeout(120)
def test_a_refused_re_registration_is_not_retried_on_every_request(daemon_factory):
    """An engine whose re-registration the daemon refuses (its tenant was removed by a
    restart) gets that refusal as a miss on each request, but asks the daemon again at most
    once per ``REFUSED_RETRY_S``: each try hands its memory over and takes the daemon's
    time, and a busy engine makes thousands of requests a second."""
    from kvtier.client.connection.connection import REFUSED_RETRY_S

    from kvtier.client.connection.replies import DaemonError

    d = daemon_factory("--admin-token", ADMIN, "--tenants", tenants_json("ab"))
    p, c = engine(d.runtime_dir, tenant="b", token="tok-b-5a9e31", num_pages=16)
    try:
        keys = c.page_keys(tokens(2 * 16, salt=2))
        assert d.stop() == 0
        refusals: list[float] = []  # when the daemon refused a registration (any thread's)
        register = c.register

        def counted() -> None:
            try:
                register()
            except DaemonError:
                refusals.append(time.monotonic())
                raise

        c.register = counted  # type: ignore[method-assign]
        d = daemon_factory("--admin-token", ADMIN, "--tenants", tenants_json("a"))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5 * REFUSED_RETRY_S:  # requests as fast as they go
            assert c.lookup(keys).l2 == 0
        assert len(refusals) >= 2, f"the refusal is never asked again: {refusals}"
        gaps = [b - a for a, b in itertools.pairwise(refusals)]
        assert min(gaps) >= 0.9 * REFUSED_RETRY_S, (
            f"asked again {min(gaps):.3f} s after a refusal (REFUSED_RETRY_S {REFUSED_RETRY_S})"
        )
    finally:
        c.close()
        p.close()


@pytest.mark.timeout(120)
def test_a_refusal_is_not_held_against_the_next_daemon(monkeypatch, daemon_factory):
    """A refusal is repeated without asking only while the daemon that refused it runs: once
    it is gone, its successor (restarted with the tenant configured again) is asked on the
    next request, however long the pause after a refusal is."""
    from kvtier.client.connection import connection

    monkeypatch.setattr(connection, "REFUSED_RETRY_S", 600.0)
    d = daemon_factory("--admin-token", ADMIN, "--tenants", tenants_json("ab"))
    p, c = engine(d.runtime_dir, tenant="b", token="tok-b-5a9e31", num_pages=16)
    try:
        keys = c.page_keys(tokens(4 * 16, salt=3))
        assert d.stop() == 0
        d = daemon_factory("--admin-token", ADMIN, "--tenants", tenants_json("a"))
        assert c.lookup(keys).l2 == 0
        assert c._refused is not None, "the removed tenant's registration was not refused"
        assert d.stop() == 0
        d = daemon_factory("--admin-token", ADMIN, "--tenants", tenants_json("ab"))
        h = c.store(keys, [0, 1, 2, 3])
        assert h.count == 4 and h.wait(), "the restarted daemon was never asked"
        assert c.lookup(keys).l2 == 4
    finally:
        c.close()
        p.close()
