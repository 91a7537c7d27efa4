"""kvtierd when the host runs out of something: space in pool_dir or state_dir, descriptors.

Not repeated here (see test_constrained_hosts.py, test_host_memory_limits.py): a pool_dir too
small at start, a new sparse pool whose pool_dir fills up, a full runtime dir, a full L3 file
store, unsealed memfds' descriptors.

Mounting tests mount their own small tmpfs (root only; skipped elsewhere) and unmount it at
teardown; descriptor tests lower the running daemon's ``RLIMIT_NOFILE`` with ``prlimit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time

import pytest
import zmq
from kvtier.bench.local_servers import free_ports
from kvtier.client.connection.admin import AdminClient
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, fill_page, tokens
from tests.integration.test_admin_plane_scope import store
from tests.integration.test_constrained_hosts import blames_pool_dir, fill, health, tmpfs
from tests.integration.test_kv_events import event_flags, events, hashes, subscriber
from tests.integration.test_l3_tier import wait_for
from tests.integration.test_state_files_across_restarts import (
    ADMIN,
    TOKEN_A,
    call,
    flush_l3,
)
from tests.integration.test_state_files_across_restarts import flags as state_flags

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _lower_fd_limit(pid: int, soft: int) -> int:
    """Lower ``pid``'s soft RLIMIT_NOFILE to ``soft`` (its hard one stays); the old soft."""
    old, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    return old


def _restore_fd_limit(d, soft: int) -> None:
    if d.proc is not None and d.proc.poll() is None:
        with contextlib.suppress(OSError):
            hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)[1]
            resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (soft, hard))


def _died(d) -> str:
    code = d.proc.poll()
    return f"kvtierd exited with {code}:\n{d.log_tail(5)}"


# ------------------------------------------------ pool_dir: an adopted pool that is sparse


@needs_root
@pytest.mark.timeout(90)
def test_an_adopted_sparse_pool_on_a_full_pool_dir_is_not_blamed_on_the_engine(
    daemon_factory, short_tmp
):
    """An operator ran kvtierd with ``prefault = false`` (the pool file is sparse), then
    restarts it with the default ``prefault = true`` after another process filled the
    shared /dev/shm: the new daemon cannot reserve the adopted file's holes, says so, and a
    STORE into slots the file system cannot back fails naming pool_dir / no space (as for a
    sparse pool the daemon created itself), never blaming the engine's memory ("the engine
    shrank its memfd")."""
    shm = short_tmp / "shm"
    with tmpfs(shm, "32m"):
        flags = ("--pool-dir", str(shm), "--hicache-size", "16MiB")
        a = daemon_factory(*flags, "--prefault", "false")
        try:
            pool, conn = engine(a.runtime_dir)
            try:
                fill_page(pool, 0, seed=1)
                assert conn.store(conn.page_keys(tokens(SMALL.page_size, salt=1)), [0]).wait()
            finally:
                conn.close()
                pool.close()
            assert a.stop() == 0
            fill(shm)  # another container / process writes to the same /dev/shm
            b = daemon_factory(*flags)  # prefault = true: the default
            try:
                pool, conn = engine(b.runtime_dir, request_timeout_s=3.0, load_timeout_s=5.0)
                try:
                    keys = conn.page_keys(tokens(32 * SMALL.page_size, salt=3))
                    stored = conn.store(keys, list(range(32))).wait()
                finally:
                    conn.close()
                    pool.close()
                assert b.proc.poll() is None, _died(b)
                assert stored is False
                blames_pool_dir(b)
            finally:
                b.stop()
        finally:
            a.stop()
            a.remove_pool(shm)


# ------------------------------------------------ state_dir: the KV events' name log


@needs_root
@pytest.mark.timeout(120)
def test_a_name_record_cut_short_by_a_full_state_dir_loses_no_later_namespace(
    daemon_factory, short_tmp
):
    """The state directory fills up while engines register (a full /var/lib volume): the
    record of one new namespace fits ``kv-event-namespaces.log`` only in part (a short
    ``write``, cut back). Space comes back, an engine of model D registers and stores, and
    kvtierd crashes. The restarted daemon announces D's adopted pages on D's model topic
    (docs/events.md: a namespace's model id does not wait for a clean stop): no torn record
    in the middle of the log hides the records after it."""
    st = short_tmp / "state"
    with tmpfs(st, "1m"):
        flags = (*event_flags(short_tmp), "--state-dir", str(st))
        d = daemon_factory(*flags)
        try:

            def register(model: str, store: bool = False) -> str | None:
                pool, conn = engine(d.runtime_dir, model=model)
                try:
                    if store:
                        keys = conn.page_keys(tokens(4 * SMALL.page_size, salt=7))
                        assert conn.store(keys, [0, 1, 2, 3]).wait()
                        return E.namespace_topic(model, conn.ns_fingerprint)
                    return None
                finally:
                    conn.close()
                    pool.close()

            long_ids = [c * 1500 for c in "ABC"]  # ~1.5 KiB records: the third crosses 4 KiB
            register(long_ids[0])
            fill(st)
            register(long_ids[1])
            register(long_ids[2])  # cut short: the file system had part of a page left
            (st / "filler").unlink()  # space comes back
            model_d = "model-d"
            topic = register(model_d, store=True)
            d.kill()  # a crash: no clean stop saved the names
            d = daemon_factory(*flags)
            with (
                subscriber(short_tmp) as every,
                subscriber(short_tmp, topic=E.model_topic(model_d)) as model,
            ):
                announced = wait_for(
                    lambda: every.replay(0) or None, what="the announcement of the adopted pages"
                )
                seen = {m.topic for m in announced}
                got = model.replay(0)
                assert {m.topic for m in got} == {topic}, (
                    f"{model_d}'s pages announced on {seen}, not on {topic}"
                )
                assert len(hashes(events(got, E.BlockStored, "CPU"))) == 4
        finally:
            d.stop()
            d.remove_pool()


# ------------------------------------------------ state_dir: the tenants' namespaces


@needs_root
@pytest.mark.timeout(150)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_namespace_its_tenant_file_cannot_name_reaches_l3_only_once_saved(
    daemon_factory, short_tmp, policy
):
    """Tenants are configured and state_dir fills up (the file L3 store is on another
    volume). Tenant a's engine registers a new model: the file naming each namespace's
    tenant cannot be saved, so its pages stay in L2 and are not written to L3 (SYNC counts
    them failed; HEALTH says why): after a crash then, tenant a's FLUSH of L3 could not
    find them. kvtierd is killed, space comes back, it starts again and adopts the pages:
    the pool's owners tell whose the unnamed namespace is, so a SYNC writes its pages and
    a's FLUSH of L3 deletes them with the others. Then, without a crash: full again, a new
    namespace's pages given up, space back: the save tried again on its own succeeds and
    the pages are written with no SYNC asked for."""
    st = short_tmp / "state"
    with tmpfs(st, "1m"):
        extra = json.dumps({"path": str(short_tmp / "l3")})
        d = daemon_factory(
            *state_flags(st, "--hicache-storage-backend-extra-config", extra),
            "--hicache-write-policy",
            policy,
        )

        def sync() -> P.SyncReply:
            rep = call(d, P.Sync(req_id=0, admin_token=ADMIN, timeout_s=20.0), ADMIN)
            assert isinstance(rep, P.SyncReply), rep
            return rep

        def stored(model: str, n: int, salt: int) -> bytes:
            pool, conn = engine(d.runtime_dir, model=model, tenant="a", token=TOKEN_A)
            try:
                store(conn, pool, n, salt=salt)
                return conn.ns_fingerprint
            finally:
                conn.close()
                pool.close()

        def written() -> int:
            snap = call(d, P.Stats(req_id=0, admin_token=ADMIN), ADMIN).stats
            return int(snap["counters"]["l3_write_written_pages"])

        try:
            stored("m", 3, salt=11)
            rep = sync()
            assert (rep.failed, rep.left) == (0, 0), rep
            fill(st)
            m2 = stored("m2", 3, salt=12)
            rep = sync()
            assert (rep.written, rep.failed) == (0, 3), (
                f"with the tenant file unsaved, SYNC found {3 - rep.failed} pages of a new "
                f"namespace in L3 or wrote them ({rep}): a FLUSH after a crash would miss them"
            )
            status = health(d)
            assert status.startswith("degraded") and "state_dir" in status, status
            d.kill()  # a crash while state_dir is full
            (st / "filler").unlink()
            d.start()
            rep = call(d, P.Stats(req_id=0, admin_token=ADMIN, namespaces=True), ADMIN)
            assert isinstance(rep, P.StatsReply), rep
            rows = rep.stats["namespaces"]
            assert {r["namespace"]: r["tenant"] for r in rows}.get(m2.hex()) == "a", rows
            rep = sync()  # waits for the back-up of the adopted pages (write-through)
            assert (rep.failed, rep.left) == (0, 0), rep
            mine = flush_l3(d, TOKEN_A)
            left = flush_l3(d, ADMIN)
            assert (mine.l3_pages, mine.l3_error, left.l3_pages) == (6, "", 0), (
                f"after a crash, tenant a's FLUSH of L3 deleted {mine.l3_pages} of its 6 "
                f"pages ({mine.l3_error!r}); {left.l3_pages} were still in L3"
            )
            # the recovery without a crash: full, a new namespace given up, space back
            rep = call(d, P.Flush(req_id=0, tier="l2", admin_token=ADMIN), ADMIN)
            assert isinstance(rep, P.FlushReply) and rep.l2_pages == 6, rep
            fill(st)
            stored("m3", 2, salt=13)
            rep = sync()
            assert (rep.written, rep.failed) == (0, 2), rep
            before = written()
            (st / "filler").unlink()
            wait_for(lambda: health(d) == "ok" or None, what="HEALTH ok once saved", timeout=20)
            wait_for(lambda: written() == before + 2 or None, what="the given-up pages written")
            assert flush_l3(d, TOKEN_A).l3_pages == 2
        finally:
            d.stop()
            d.remove_pool()


# ------------------------------------------------ descriptors


@pytest.mark.timeout(90)
def test_a_handover_cut_short_by_the_daemons_descriptor_limit_is_busy_not_bad_memory(
    daemon_factory,
):
    """kvtierd at its descriptor limit (``LimitNOFILE``, a container's ``ulimit -n``) while
    engines register: the kernel cannot install an engine's memfd on the handover socket
    (``MSG_CTRUNC``), or the completion block cannot be made. The engine is refused as busy
    (or its connection is shut down), never ``BAD_MEMORY`` as if its memory were bad (which
    it would not retry), and HEALTH says ``degraded`` (README: running out of descriptors
    refuses the one request)."""
    d = daemon_factory()
    old = _lower_fd_limit(d.pid, _fds(d.pid) + 24)
    engines, refusal = [], None
    try:
        for i in range(40):
            try:
                engines.append(engine(d.runtime_dir, model=f"m{i}", request_timeout_s=2.0))
            except Exception as err:
                refusal = err
                break
        assert d.proc.poll() is None, _died(d)
        assert refusal is not None, "40 engines registered under a limit of about 50 descriptors"
        assert "more than 64 descriptors" not in str(refusal) and "BAD_MEMORY" not in str(
            refusal
        ), f"an engine is blamed for the daemon's descriptor shortage: {refusal}"
    finally:
        for pool, conn in engines:
            conn.close()
            pool.close()
    try:  # asked once the engines are gone (the shortage is reported for a minute after)
        with AdminClient(d.endpoint, timeout_s=5.0) as admin:
            status = admin.health().status
        assert status.startswith("degraded"), f"HEALTH {status!r} after the descriptor limit"
    finally:
        _restore_fd_limit(d, old)


def _limits(d) -> dict:
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return admin.stats()["limits"]


@pytest.mark.timeout(90)
def test_kv_event_subscribers_past_their_share_are_shut_down_and_engines_still_connect(
    daemon_factory,
):
    """KV events on TCP and routers' subscribers connecting without end (a subscriber that
    leaks sockets): each connection holds one of kvtierd's descriptors, and at its limit
    libzmq aborts the process. The peers of a ``tcp://`` endpoint count as one user: past
    half the connections bound (1/8 of the descriptor limit) each new one is shut down, the
    daemon lives, and an engine still registers and stores."""
    pub, rep = free_ports(2)
    d = daemon_factory(
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}",
    )  # fmt: skip
    hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (512, min(hard, 512)))
    total, per_user = (
        _limits(d)["bounds"]["connections"],
        _limits(d)["bounds"]["connections_per_user"],
    )
    assert (total, per_user) == (512 // 8, 512 // 16)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # ours: 600 sockets' descriptors
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(600):  # a leak past the limit: one at a time, never closed
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(f"tcp://127.0.0.1:{pub}")
            socks.append(s)
            time.sleep(0.002)
        wait_for(
            lambda: _limits(d)["refusals"].get("connections_per_user", 0) >= per_user,
            timeout=10.0,
            what="the subscribers past the share shut down",
        )
        assert d.proc.poll() is None, _died(d)
        pool, conn = engine(d.runtime_dir, request_timeout_s=5.0)
        try:
            keys = conn.page_keys(tokens(2 * SMALL.page_size, salt=5))
            fill_page(pool, 0, seed=1)
            fill_page(pool, 1, seed=2)
            assert conn.store(keys, [0, 1]).wait()
            assert conn.lookup(keys).l2 == 2
        finally:
            conn.close()
            pool.close()
        limits = _limits(d)
        assert limits["users"]["-1"]["connections"] < total, limits["users"]
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
