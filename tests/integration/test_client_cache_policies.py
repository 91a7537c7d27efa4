"""The engine-side client library's HiCache policies against a real kvtierd.

The reference engine (``kvtier.engine``) and the cache manager (``kvtier.client.cache``) run
over real daemons; what L2 holds is asked of the daemon (LOOKUP), and every output is compared
with the same model run without kvtier. Covered here:

- write_back after L2 lost pages the L1 tree had recorded as held there (an L2 FLUSH, as
  eviction by other engines does, or a kvtierd restarted cold): the next eviction from L1
  must back the prefix up again, not drop it for good;
- the client's ``hicache_storage_prefetch_policy`` deciding how a CLAIM ends a prefetch;
- prompts that are not a multiple of the page size, partly in L1 and partly in L2, and
  namespaces (model, cache salt) that never share a page;
- concurrent requests sharing a prefix through one cache manager, with loads in flight
  while other requests insert and evict.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
from kvtier.client.cache.manager import CacheManager
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.engine.allocator import PageAllocator
from kvtier.engine.engine import GenerationResult, ReferenceEngine
from kvtier.engine.model import ModelConfig, TinyLlama
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config, engine, fill_page, page_bytes, tokens
from tests.integration.test_l3_tier import (
    REPO,
    l3_flags,
    slow_flags,
    stored_then_evicted,
    wait_written,
)

PAGE = 16
TOL = 1e-4


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_same(got: GenerationResult, want: GenerationResult) -> None:
    assert got.tokens == want.tokens
    diff = float((got.first_logits - want.first_logits).abs().max())
    assert diff < TOL, f"first logits differ by {diff}"


def flush_l2(endpoint: str) -> int:
    with AdminClient(endpoint, timeout_s=10.0) as admin:
        rep = admin.call(P.Flush(req_id=0, tier="l2"))
    assert isinstance(rep, P.FlushReply), rep
    return rep.l2_pages


@pytest.fixture
def tiny() -> TinyLlama:
    return TinyLlama(ModelConfig.tiny())


@pytest.fixture
def engines(tiny):
    """``make(rdir, mode, **client_config)``: reference engines on the tiny model, closed at
    the end."""
    made: list[ReferenceEngine] = []

    def make(rdir, mode: str = "on", num_pages: int = 64, **cfg) -> ReferenceEngine:
        made.append(
            ReferenceEngine(
                mode=mode,  # type: ignore[arg-type]
                page_size=PAGE,
                num_pages=num_pages,
                client_config=client_config(rdir, **cfg),
                model=tiny,
            )
        )
        return made[-1]

    yield make
    for e in reversed(made):
        e.close()


# ---------------------------------------------------------------------------- write_back


@pytest.mark.timeout(90)
@pytest.mark.parametrize("lost_by", ["flush", "cold_restart"])
def test_write_back_backs_a_prefix_up_again_after_l2_lost_it(
    daemon_factory, engines, tiny, lost_by
):
    """Under write_back an L1 page reaches L2 only when L1 evicts it. Pages the engine once
    loaded from L2 are recorded in the L1 tree as held by L2; when L2 loses them (evicted for
    other engines' pages, flushed, or a kvtierd restarted cold) and a lookup has shown the
    engine that they are gone (it recomputes them), the next eviction must store them again:
    a mark "in L2" kept for ever would make every eviction skip them, and the prefix would be
    recomputed on every request from then on, never stored again."""
    d = daemon_factory()
    on = engines(d.runtime_dir, hicache_write_policy="write_back")
    off = engines(d.runtime_dir, mode="off")
    p = prompt(6 * PAGE + 3, tiny.cfg.vocab_size, 21)
    full_pages = 6 * PAGE
    assert on.cache is not None

    on.generate(p, 2)
    assert on.flush_l1() == 6  # written back
    assert on.cache.stored_prefix_tokens(p) == full_pages
    loaded = on.generate(p, 2)
    assert loaded.cached_l2 == full_pages  # the tree now records them as in L2

    if lost_by == "flush":
        assert flush_l2(d.endpoint) == 6
    else:
        d.stop()
        d = daemon_factory("--cold-start", name="d0")  # same runtime dir, pool discarded
    assert on.cache.stored_prefix_tokens(p) == 0

    on.flush_l1()  # the eviction asks L2 about the pages marked as held there
    assert on.cache.stored_prefix_tokens(p) == full_pages, "the evicted prefix is in no tier"
    back = on.generate(p, 2)
    assert (back.cached_l1, back.cached_l2, back.computed) == (0, full_pages, 3)
    assert_same(back, off.generate(p, 2))

    # lost again while off the device (the tree keeps them, marked as held by L2): the
    # next lookup unmarks them, the engine recomputes them, and the eviction stores them
    on.flush_l1()
    if lost_by == "flush":
        assert flush_l2(d.endpoint) == 6
    else:
        d.stop()
        d = daemon_factory("--cold-start", name="d0")
    again = on.generate(p, 2)
    assert (again.cached_l1, again.cached_l2, again.computed) == (0, 0, len(p))
    assert_same(again, off.generate(p, 2))
    on.flush_l1()
    assert on.cache.stored_prefix_tokens(p) == full_pages


# ---------------------------------------------------------------------------- prefetch policy


@pytest.mark.timeout(60)
def test_claim_without_a_policy_follows_the_clients_prefetch_policy(daemon_factory, short_tmp):
    """``ClientConfig.hicache_storage_prefetch_policy`` says how a claim that names no policy
    ends a prefetch (docs/configuration.md, Engines): here ``wait_complete`` (every page),
    whatever the daemon's default (``best_effort``: only what is read by then, nothing on a
    slow L3)."""
    delay = 0.3
    d = daemon_factory(
        *slow_flags(short_tmp, delay, hicache_storage_prefetch_policy="best_effort"),
        env={"PYTHONPATH": REPO},
    )
    pool, conn, keys, expected = stored_then_evicted(d, 32)
    try:
        assert conn.lookup(keys).l2 == 0
        with Connection(
            pool,
            model_id="m",
            config=client_config(d.runtime_dir, hicache_storage_prefetch_policy="wait_complete"),
        ) as waiting:
            assert waiting.ns_fingerprint == conn.ns_fingerprint
            assert waiting.prefetch(keys) == 32
            got = waiting.claim(keys)  # no policy named: the client's wait_complete
            assert got == 32, f"claim ended the prefetch with {got} of 32 pages in L2"
            dst = list(range(32, 64))
            h = waiting.load(keys, dst)
            assert h.count == 32 and h.wait()
            assert [page_bytes(pool, p) for p in dst] == expected
    finally:
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- failed stores

# 1 MiB pages (8 layers of 64 KiB K and V): a 64-page STORE is 64 MiB, several milliseconds of
# copying, so the daemon can be stopped in the middle of it.
WIDE = P.Geometry(num_layers=8, page_size=32, kv_heads=8, head_dim=64, dtype="float32")


class _StoreRecordingConnection(Connection):
    """A real connection that keeps the handle of its last STORE (for the test to wait on)."""

    last_store = None

    def store(self, keys, pages, parent_key=None, engine=None):  # type: ignore[override]
        handle = super().store(keys, pages, parent_key=parent_key, engine=engine)
        self.last_store = handle
        return handle


@pytest.mark.timeout(180)
def test_a_store_that_timed_out_never_leaves_a_reused_pages_bytes_in_l2(daemon_factory):
    """A write_through STORE whose wait failed (the daemon stalled mid-copy: SIGSTOP here)
    may still be copying when the daemon resumes. Its device pages must stay out of use
    until it stopped, as a failed load's pages are quarantined and the engine copy mode keeps
    a failed store's staging slots (``StagingArea.release(..., in_use)``): otherwise L1
    evicts them, another request writes its KV into them, and the resumed copy commits that
    KV under the first prompt's keys, to be loaded by every later request with that prefix
    (whether the resumed copy commits or the client's RELEASE cancels it is a race; the
    pages must be held back either way, and come back once it has ended)."""
    n = 64
    total = 2 * n + 4
    toks = tokens(n * WIDE.page_size + 1).tolist()
    conclusive = 0
    for attempt in range(4):
        d = daemon_factory("--hicache-size", "160MiB", "--extent-size", "32MiB", name=f"w{attempt}")
        pool = SharedKVPool(WIDE, total)
        conn = _StoreRecordingConnection(
            pool,
            model_id="wide",
            config=client_config(
                d.runtime_dir,
                hicache_write_policy="write_through",
                request_timeout_s=0.5,
                load_timeout_s=0.5,
            ),
        )
        alloc = PageAllocator(total)
        cm = CacheManager(alloc, conn)
        stopped = False
        try:
            m = cm.match(toks)
            new = cm.alloc(n + 1)
            for i, page in enumerate(new[:n]):  # the prefill's KV
                fill_page(pool, page, 1000 + i)
            want = [page_bytes(pool, page) for page in new[:n]]
            cm.insert(m, new[:n])  # write_through: STORE of the 64 pages
            h = conn.last_store
            assert h is not None and h.writing == n
            os.kill(d.pid, signal.SIGSTOP)  # at once: the copy has just started
            stopped = True
            if h.layers_ready() >= WIDE.num_layers:
                continue  # every layer was copied before the stop: nothing late to come
            cm.release(m)  # the wait for the STORE times out: a failed store
            cm.free(new[n:])
            if cm.counters.store_failures == 0:
                continue  # it completed after all
            if not h.copying():
                continue  # it ended meanwhile
            conclusive += 1
            cm.flush_l1()
            # another request's KV, in every page the manager hands out now: never one the
            # stalled STORE may still read
            reused = cm.alloc(alloc.free_count)
            assert not set(reused) & set(new[:n]), "a page the STORE may still read was reused"
            assert cm.quarantined_pages == n
            for page in reused:
                fill_page(pool, page, 7)
            os.kill(d.pid, signal.SIGCONT)
            stopped = False
            deadline = time.monotonic() + 20
            while h.copying():
                assert time.monotonic() < deadline, "the resumed STORE never ended"
                time.sleep(0.02)
            keys = m.keys[:n]
            held = conn.lookup(keys).l2  # committed, or cancelled by the RELEASE: either way
            if held:  # what L2 holds is the first prompt's KV
                dst = reused[:held]
                ld = conn.load(keys[:held], dst)
                assert ld.count == held and ld.wait()
                wrong = sum(page_bytes(pool, p) != w for p, w in zip(dst, want[:held]))
                assert wrong == 0, f"{wrong} of {held} pages in L2 hold another request's KV"
            cm.free(reused)
            # once the STORE has ended, its pages come back: every page can be taken again
            assert len(cm.alloc(total)) == total and cm.quarantined_pages == 0
            break
        finally:
            if stopped:
                os.kill(d.pid, signal.SIGCONT)
            cm.close()
            conn.close()
            pool.close()
    assert conclusive, "the STORE never failed while still copying, 4 times"


# ---------------------------------------------------------------------------- covered behaviour


@pytest.mark.timeout(90)
@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_prompts_around_a_page_boundary_mix_l1_and_l2_and_equal_a_recompute(
    daemon, engines, tiny, extra
):
    """A prompt of k pages and ``extra`` tokens, its head in L1 and the rest of its cached
    prefix in L2: at most ``(len - 1) // page_size`` pages are reused (the last token is
    always computed), L1 first, and the output equals the uncached model's."""
    on = engines(daemon.runtime_dir, num_pages=24)
    off = engines(daemon.runtime_dir, mode="off")
    base = prompt(12 * PAGE, tiny.cfg.vocab_size, 31)
    on.generate(base, 1)  # write_through: all 12 pages in L2
    assert on.flush_l1() == 12
    head = on.generate(base[: 4 * PAGE + 3], 1)  # pages 0-3 back in L1 (loaded)
    assert head.cached_l2 == 4 * PAGE
    p = base[: 9 * PAGE + extra] if extra <= 0 else base[: 9 * PAGE] + [5] * extra
    usable = (len(p) - 1) // PAGE
    got = on.generate(p, 5)
    assert (got.cached_l1, got.cached_l2) == (4 * PAGE, (usable - 4) * PAGE)
    assert got.computed == len(p) - usable * PAGE
    assert_same(got, off.generate(p, 5))
    again = on.generate(p, 5)  # now all in L1
    assert (again.cached_l1, again.cached_l2) == (usable * PAGE, 0)
    assert_same(again, off.generate(p, 5))


@pytest.mark.timeout(90)
def test_engines_of_other_models_or_salts_never_reuse_each_others_pages(daemon, engines, tiny):
    """The same tokens under another model (weights) or another cache salt name other pages:
    nothing is found in L2, and each engine's output equals its own model's recompute."""
    p = prompt(8 * PAGE + 5, tiny.cfg.vocab_size, 41)
    first = engines(daemon.runtime_dir)
    first.generate(p, 1)
    assert first.cache is not None and first.cache.stored_prefix_tokens(p) == 8 * PAGE
    salted = engines(daemon.runtime_dir, cache_salt="tenant-b")
    got = salted.generate(p, 4)
    assert (got.l2_found, got.cached_l2, got.computed) == (0, 0, len(p))
    other_model = TinyLlama(dataclasses.replace(ModelConfig.tiny(), seed=12345))
    with (
        ReferenceEngine(
            mode="on",
            page_size=PAGE,
            num_pages=64,
            client_config=client_config(daemon.runtime_dir),
            model=other_model,
        ) as other,
        ReferenceEngine(mode="off", page_size=PAGE, num_pages=64, model=other_model) as ref,
    ):
        theirs = other.generate(p, 4)
        assert (theirs.l2_found, theirs.cached_l2) == (0, 0)
        assert_same(theirs, ref.generate(p, 4))
    # and the first model still finds its own pages
    mine = engines(daemon.runtime_dir).generate(p, 4)
    assert mine.cached_l2 == 8 * PAGE
    assert_same(mine, engines(daemon.runtime_dir, mode="off").generate(p, 4))


def _key_seed(key: bytes) -> int:
    return int.from_bytes(key[:3], "little") + 1


@pytest.mark.timeout(60)
def test_concurrent_requests_sharing_a_prefix_load_insert_and_free_exactly(daemon):
    """Two requests match the same prompt while its prefix is only in L2, both load it,
    the first inserts and the second finds its pages duplicates: every page read holds its
    key's bytes, the tree keeps one copy, and every page goes back to the allocator."""
    ps = SMALL.page_size
    pool, conn = engine(daemon.runtime_dir, SMALL, num_pages=32, model="shared-prefix")
    alloc = PageAllocator(32)
    cm = CacheManager(alloc, conn)
    try:
        toks = tokens(6 * ps + 3, salt=11).tolist()
        m0 = cm.match(toks)
        pages0 = cm.alloc(7)
        for i in range(6):
            fill_page(pool, pages0[i], _key_seed(m0.keys[i]))
        want = [page_bytes(pool, p) for p in pages0[:6]]
        cm.insert(m0, pages0[:6])
        cm.release(m0)
        cm.free(pages0[6:])
        assert cm.flush_l1() == 6 and alloc.free_count == 32  # the prefix is only in L2 now

        ma, mb = cm.match(toks), cm.match(toks)
        assert (len(ma.l1_pages), ma.l2_pages) == (len(mb.l1_pages), mb.l2_pages) == (0, 6)
        pa, pb = cm.alloc(7), cm.alloc(7)
        la, lb = cm.load(ma, pa[:6]), cm.load(mb, pb[:6])
        assert la.pages == lb.pages == 6
        assert lb.finish() and la.finish()
        assert [page_bytes(pool, p) for p in pa[:6]] == want
        assert [page_bytes(pool, p) for p in pb[:6]] == want
        assert cm.insert(ma, pa[:6]) == []
        dups = cm.insert(mb, pb[:6])
        assert dups == pb[:6]
        cm.tree.check_invariants()
        cm.release(ma)
        cm.release(mb)
        cm.free(pa[6:])
        cm.free(pb)
        assert alloc.free_count == 32 - 6 and cm.tree.device_page_count == 6
        m = cm.match(toks)
        assert (len(m.l1_pages), m.l2_pages) == (6, 0) and m.l1_pages == pa[:6]
        cm.release(m)
        assert cm.counters.loaded_tokens == 12 * ps and cm.counters.load_failures == 0
    finally:
        cm.close()
        conn.close()
        pool.close()


# ---------------------------------------------------------------------------- L3 prefetch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_a_prefix_only_l3_holds_is_prefetched_claimed_and_loaded(
    daemon_factory, engines, tiny, short_tmp, policy
):
    """HiCache's prefetch in the client library: a prefix L3 holds (L2 lost it) is read
    into L2 from the match on (PREFETCH), claimed by the load as the prefetch policy says,
    and loaded with the L2 run; the output equals the model's without kvtier."""
    d = daemon_factory(
        *l3_flags("file", {"path": str(short_tmp / "l3")}, prefetch_threshold="0"),
        "--hicache-write-policy",
        "write_through",
    )
    on = engines(d.runtime_dir, prefetch_threshold=0, hicache_storage_prefetch_policy=policy)
    off = engines(d.runtime_dir, mode="off")
    p = prompt(10 * PAGE + 5, tiny.cfg.vocab_size, 51)
    first = on.generate(p, 3)
    assert first.cached_l2 == first.cached_l3 == 0
    wait_written(d, 10)
    assert on.flush_l1() == 10 and flush_l2(d.endpoint) == 10
    assert on.cache is not None and on.cache.stored_prefix_tokens(p) == 0  # in L3 alone
    got = on.generate(p, 3)
    assert (got.l2_found, got.l3_found) == (0, 10 * PAGE)
    assert (got.cached_l1, got.cached_l2, got.cached_l3) == (0, 0, 10 * PAGE)
    assert got.computed == len(p) - 10 * PAGE
    assert on.cache.counters.l3_claimed_tokens == 10 * PAGE
    assert_same(got, off.generate(p, 3))
    again = on.generate(p, 3)  # now in L1
    assert again.cached_l1 == 10 * PAGE
    assert_same(again, off.generate(p, 3))


@pytest.mark.timeout(120)
def test_a_prefix_in_l3_below_the_prefetch_threshold_is_computed(
    daemon_factory, engines, tiny, short_tmp
):
    """A run in L3 shorter than the client's ``prefetch_threshold`` is not read: the engine
    computes it (nothing claimed), and the output is the model's."""
    d = daemon_factory(
        *l3_flags("file", {"path": str(short_tmp / "l3")}, prefetch_threshold="0"),
    )
    on = engines(d.runtime_dir, prefetch_threshold=4 * PAGE)
    off = engines(d.runtime_dir, mode="off")
    p = prompt(3 * PAGE + 1, tiny.cfg.vocab_size, 52)
    on.generate(p, 2)
    wait_written(d, 3)
    assert on.flush_l1() == 3 and flush_l2(d.endpoint) == 3
    got = on.generate(p, 2)
    assert (got.l3_found, got.cached_l3, got.computed) == (3 * PAGE, 0, len(p))
    assert on.cache is not None and on.cache.counters.l3_claimed_tokens == 0
    assert_same(got, off.generate(p, 2))
