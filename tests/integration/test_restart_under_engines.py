"""kvtierd restarting under engines that keep running: what the engines see afterwards.

Each test runs real kvtierd processes on one runtime directory (so the second adopts the
pool file the first left) and real engine connections that live across the restart.
"""

from __future__ import annotations

import threading
import time

import pytest
from kvtier.client.connection.admin import AdminClient

from tests.engines import SMALL, engine, fill_page, tokens
from tests.integration.test_tp_groups import Ranks


def sessions(d) -> int:
    with AdminClient(d.endpoint, timeout_s=5.0) as admin:
        return len(admin.stats()["sessions"])


@pytest.mark.timeout(90)
def test_a_tp_engine_whose_rank_missed_a_lookup_during_a_restart_keeps_its_hits(
    daemon_factory,
):
    """A TP engine (two ranks, each counting its LOOKUPs as the client does) keeps running
    while kvtierd is killed and restarted. One rank's LOOKUP falls into the gap (a miss at
    once, counted but never sent, as docs/protocol.md says a rank counts "those it could
    not send"); the other rank's LOOKUP of the same request reaches the new daemon and
    ends at the group deadline. Meanwhile the first rank's heartbeat thread registers it
    with the new daemon by itself.

    From the next request on, the ranks' k-th LOOKUPs are matched again, so a prefix both
    ranks stored (and the new daemon adopted) is a hit of its full length for both ranks,
    as it was before the restart.
    """
    flags = ("--tp-group-timeout-s", "1")
    d = daemon_factory(*flags)
    ranks = Ranks(d.runtime_dir)  # heartbeat_interval_s 0.5 (tests.engines.client_config)
    try:
        keys = {s: ranks.keys(4, salt=s) for s in range(6)}
        for s in range(6):
            for rank in (0, 1):
                ranks.store(rank, keys[s][rank], seed=s + 1)
        assert ranks.each(lambda k: ranks.conns[k].lookup(keys[0][k]).l2) == [4, 4]

        d.kill()
        assert ranks.conns[1].lookup(keys[1][1]).l2 == 0  # in the gap: a miss, counted
        d = daemon_factory(*flags)

        got: dict[str, int] = {}
        rank0 = threading.Thread(
            target=lambda: got.setdefault("x", ranks.conns[0].lookup(keys[1][0]).l2)
        )
        rank0.start()  # registers with the new daemon and waits in its round for rank 1
        deadline = time.monotonic() + 10
        while sessions(d) < 2:  # rank 1's heartbeat thread registers it again by itself
            assert time.monotonic() < deadline, "rank 1 did not register again"
            time.sleep(0.05)
        rank0.join(10)
        assert not rank0.is_alive()
        assert got["x"] == 0  # rank 1 never asked this one: 0 at the deadline

        after = [
            ranks.each(lambda k, s=s: ranks.conns[k].lookup(keys[s][k]).l2) for s in (2, 3, 4, 5)
        ]
        assert after == [[4, 4]] * 4, (
            f"requests 2-5 after the restart: the ranks got {after} (rank 0, rank 1) for "
            "prefixes both stored and the new daemon adopted"
        )
    finally:
        ranks.close()


@pytest.mark.timeout(90)
def test_write_through_sends_l1_pages_again_after_a_daemon_restart_lost_them(daemon_factory):
    """An engine (the cache manager, ``write_through``) keeps a prompt's pages in L1 and
    had them stored in L2. kvtierd is restarted without its pool (``--cold-start``, or a
    configuration change that discards the file): the new epoch's L2 is empty. The engine
    serves the same prompt again from its L1.

    Pages L2 lost are sent again (write_through backs every page the engine holds up to
    L2): once the engine has re-registered with the new daemon, its L1 pages reach L2
    again, so a second engine on the node finds the prefix.
    """
    from kvtier.client.cache.manager import CacheManager
    from kvtier.engine.allocator import PageAllocator

    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, num_pages=64)
    other_pool = other = None
    try:
        cm = CacheManager(PageAllocator(64), conn)
        assert cm.write_policy == "write_through"
        toks = [int(t) for t in tokens(5 * SMALL.page_size + 1, salt=41)]

        def serve() -> None:
            m = cm.match(toks)
            l1 = len(m.l1_pages)
            new = cm.alloc(6 - l1)
            ld = cm.load(m, new[: m.l2_pages])
            ld.finish()
            table = m.l1_pages + new
            for i in range(l1, 5):
                fill_page(pool, table[i], seed=i + 7)
            dups = cm.insert(m, table[:5])
            cm.release(m)
            cm.free([p for p in new[5 - l1 :]] + list(dups))

        serve()
        keys = conn.page_keys(toks[: 5 * SMALL.page_size])
        assert conn.lookup(keys).l2 == 5  # write_through stored them

        d.kill()
        d = daemon_factory("--cold-start")
        assert conn.lookup(keys).l2 == 0  # the new epoch's L2 is empty; re-registered
        serve()  # the same prompt, from L1
        serve()
        cm.sync()

        other_pool, other = engine(d.runtime_dir, num_pages=8)
        assert other.lookup(keys).l2 == 5, (
            "the engine holds the prompt in L1 under write_through, yet L2 of the new "
            "daemon never got it"
        )
    finally:
        if other is not None:
            other.close()
        if other_pool is not None:
            other_pool.close()
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_a_request_matched_before_a_restart_stores_its_l1_pages_after_it(daemon_factory):
    """Requests interleave with a restart: request A is matched (its L1 pages marked as in
    L2), kvtierd restarts without its pool, request B is matched under the new epoch, then A
    inserts. A's L1 pages are stored to the new daemon under ``write_through``: what A's
    match said of L2 is stale."""
    from kvtier.client.cache.manager import CacheManager
    from kvtier.engine.allocator import PageAllocator

    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, num_pages=64)
    other_pool = other = None
    try:
        cm = CacheManager(PageAllocator(64), conn)
        toks = [int(t) for t in tokens(5 * SMALL.page_size + 1, salt=43)]
        m = cm.match(toks)
        new = cm.alloc(6)
        for i in range(5):
            fill_page(pool, new[i], seed=i + 3)
        cm.insert(m, new[:5])
        cm.release(m)
        cm.sync()
        keys = conn.page_keys(toks[: 5 * SMALL.page_size])
        assert conn.lookup(keys).l2 == 5

        a = cm.match(toks)  # all 5 pages from L1, marked as in L2
        assert len(a.l1_pages) == 5 and all(a.l1_in_l2)
        d.kill()
        d = daemon_factory("--cold-start")
        assert conn.lookup(keys).l2 == 0  # re-registered with the new, empty daemon
        b = cm.match([int(t) for t in tokens(SMALL.page_size + 1, salt=44)])
        cm.release(b)
        cm.insert(a, a.l1_pages[:5])
        cm.release(a)
        cm.sync()
        other_pool, other = engine(d.runtime_dir, num_pages=8)
        assert other.lookup(keys).l2 == 5, "request A's L1 pages never reached the new L2"
    finally:
        if other is not None:
            other.close()
        if other_pool is not None:
            other_pool.close()
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_an_engine_keys_its_pages_under_the_namespace_the_restarted_daemon_names(
    daemon_factory, tmp_path
):
    """kvtierd is replaced under a running engine by one that names the engine's namespace
    differently (an upgrade that changes what enters the fingerprint, which seeds every
    page key; here the layout version, set by a ``sitecustomize`` in the new daemon's
    process). The engine registers again; from then on it stores its pages under the new
    keys, those a newly started engine computes, so the two share them. A request matched
    before the restart and inserted after it is keyed anew too, and the engine's L1 hits
    stay L1 hits."""
    from kvtier.client.cache.manager import CacheManager
    from kvtier.engine.allocator import PageAllocator

    (tmp_path / "sitecustomize.py").write_text(
        "import kvtier.ipc.namespace as ns\nns.LAYOUT_VERSION += 1\n"
    )
    d = daemon_factory()
    pool, conn = engine(d.runtime_dir, num_pages=64)
    other_pool = other = None
    try:
        cm = CacheManager(PageAllocator(64), conn)
        first = [int(t) for t in tokens(5 * SMALL.page_size + 1, salt=45)]
        second = first[: 3 * SMALL.page_size] + [int(t) for t in tokens(SMALL.page_size, salt=46)]

        def serve(toks: list[int]) -> int:
            m = cm.match(toks)
            l1 = len(m.l1_pages)
            n = len(toks) // SMALL.page_size
            new = cm.alloc(n - l1)
            for i in range(l1, n):
                fill_page(pool, new[i - l1], seed=i + 11)
            dups = cm.insert(m, m.l1_pages + new)
            cm.release(m)
            cm.free(list(dups))
            return l1

        serve(first)
        old_fp = conn.ns_fingerprint
        pending = cm.match(second)  # matched under the old name, inserted after the restart
        assert len(pending.l1_pages) == 3

        d.kill()
        d = daemon_factory(env={"PYTHONPATH": str(tmp_path)})
        other_pool, other = engine(d.runtime_dir, num_pages=8)
        assert other.ns_fingerprint != old_fp
        assert conn.lookup(other.page_keys(first)).l2 == 0  # registered again
        assert conn.ns_fingerprint == other.ns_fingerprint

        new = cm.alloc(1)
        fill_page(pool, new[0], seed=99)
        cm.free(list(cm.insert(pending, pending.l1_pages + new)))
        cm.release(pending)
        assert serve(first) == 5  # still an L1 hit of the whole prompt
        cm.sync()
        got = [other.lookup(other.page_keys(t)).l2 for t in (first, second)]
        assert got == [5, 4], (
            f"a new engine finds {got} pages of the two prompts the running engine holds in "
            "L1 and stored (write_through) after the restart: [5, 4] expected"
        )
    finally:
        if other is not None:
            other.close()
        if other_pool is not None:
            other_pool.close()
        conn.close()
        pool.close()
