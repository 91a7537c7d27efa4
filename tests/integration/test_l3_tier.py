"""The storage tier (L3) through real kvtierd processes: write-through and write-back, LOOKUP's
L3 run, PREFETCH / CLAIM under each policy, FLUSH of L3, a daemon killed with SIGKILL, and two
daemons sharing one Redis or one Mooncake store."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.daemon.storage.file import FileBackend
from kvtier.daemon.tier.prefetch import read_batch
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, fill_page, page_bytes, tokens
from tests.servers import MooncakeMaster, RedisServer, serve_mooncake_master, serve_redis

REPO = str(Path(__file__).resolve().parents[2])


class SlowFileBackend(FileBackend):
    """The file backend with every ``get_into`` call delayed by ``delay_s`` and every
    ``put_from`` call by ``put_delay_s`` (loaded by the daemon as a ``dynamic`` backend,
    to make L3 slow on purpose)."""

    def __init__(self, extra_config: dict[str, Any]) -> None:
        extra = dict(extra_config)
        self.delay_s = float(extra.pop("delay_s", 0.0))
        self.put_delay_s = float(extra.pop("put_delay_s", 0.0))
        super().__init__(extra)

    async def get_into(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        await asyncio.sleep(self.delay_s)
        return await super().get_into(ns, keys, offsets, length)

    async def put_from(
        self, ns: bytes, keys: Sequence[bytes], offsets: Sequence[int], length: int
    ) -> list[bool]:
        await asyncio.sleep(self.put_delay_s)
        return await super().put_from(ns, keys, offsets, length)


def wait_for(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def runs(conn: Connection, keys: list[bytes]) -> tuple[int, int]:
    """LOOKUP as ``(l2, l3)``."""
    r = conn.lookup(keys)
    return r.l2, r.l3


def stats(daemon) -> dict[str, Any]:
    with AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
        return admin.stats()


def counters(daemon) -> dict[str, int]:
    return stats(daemon)["counters"]  # type: ignore[return-value]


def flush(daemon, tier: str) -> P.FlushReply:
    with AdminClient(daemon.endpoint, timeout_s=10.0) as admin:
        rep = admin.call(P.Flush(req_id=0, tier=tier))
    assert isinstance(rep, P.FlushReply), rep
    return rep


def wait_written(daemon, pages: int) -> None:
    wait_for(
        lambda: (
            counters(daemon)["l3_write_written_pages"] + counters(daemon)["l3_write_skipped_pages"]
            >= pages
        ),
        what=f"{pages} pages in L3",
    )


def l3_flags(backend: str, extra: dict[str, Any] | None = None, **more: str) -> list[str]:
    flags = ["--hicache-storage-backend", backend]
    if extra is not None:
        flags += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
    for name, value in more.items():
        flags += [f"--{name.replace('_', '-')}", value]
    return flags


def store_pages(
    pool: SharedKVPool, conn: Connection, n: int, salt: int = 0, seed: int = 1
) -> tuple[list[bytes], list[bytes]]:
    """Fill engine pages 0..n-1, store them under a fresh chain; return (keys, bytes)."""
    keys = conn.page_keys(tokens(n * SMALL.page_size, salt=salt))
    for p in range(n):
        fill_page(pool, p, seed=seed * 1000 + p)
    expected = [page_bytes(pool, p) for p in range(n)]
    h = conn.store(keys, list(range(n)))
    assert h.count == n and h.wait()
    return keys, expected


def load_and_compare(
    pool: SharedKVPool,
    conn: Connection,
    keys: list[bytes],
    expected: list[bytes],
    first_page: int = 32,
) -> None:
    dst = list(range(first_page, first_page + len(keys)))
    h = conn.load(keys, dst)
    assert h.count == len(keys) and h.wait()
    assert [page_bytes(pool, p) for p in dst] == expected


def fetch_back(conn: Connection, keys: list[bytes], policy: str = "wait_complete") -> int:
    conn.prefetch(keys)
    return conn.claim(keys, policy=policy)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    yield from serve_redis()


@pytest.fixture
def mooncake_master() -> Iterator[MooncakeMaster]:
    yield from serve_mooncake_master()


@pytest.mark.timeout(60)
def test_write_through_then_lookup_prefetch_claim_load(daemon_factory):
    d = daemon_factory(*l3_flags("file", prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 8)
        wait_written(d, 8)
        assert runs(conn, keys) == (8, 0)  # L2 covers it: L3 is not asked
        assert flush(d, "l2").l2_pages == 8
        assert runs(conn, keys) == (0, 8)
        assert conn.prefetch(keys) == 8
        assert conn.claim(keys, policy="wait_complete") == 8
        load_and_compare(pool, conn, keys, expected)
        c = counters(d)
        assert c["l3_prefetch_started_pages"] == c["l3_prefetch_completed_pages"] == 8
        assert c["l3_prefetch_unused_pages"] == 0 and c["lookup_l3_keys"] == 8
        l3 = stats(d)["l3"]
        assert l3["backend"] == "file" and l3["healthy"] and l3["puts"] == 8 and l3["gets"] == 8
        # a second store of the same pages writes nothing new to L3
        again = conn.store(keys, list(range(8)))
        assert again.count == 8 and again.wait()
        assert counters(d)["l3_write_queued_pages"] == 8
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_prefetch_threshold_and_partial_l3_run(daemon_factory):
    d = daemon_factory(*l3_flags("file", prefetch_threshold=str(4 * SMALL.page_size)))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 6)
        wait_written(d, 6)
        flush(d, "l2")
        assert conn.prefetch(keys[:3]) == 0  # 48 tokens < the 64-token threshold
        assert conn.prefetch_coming(keys[:3]) == 0  # and nothing else brings them
        assert conn.claim(keys[:3]) == 0
        longer = keys + conn.page_keys(tokens(2 * SMALL.page_size, salt=5), parent=keys[-1])
        assert runs(conn, longer) == (0, 6)
        assert conn.prefetch(longer) == 6
        assert conn.claim(longer, policy="wait_complete") == 6
        load_and_compare(pool, conn, keys, expected)
        # the L2 run is prefetched no further: only the pages after it are read
        assert conn.prefetch(longer, skip=6) == 0
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(90)
def test_pages_come_back_from_l3_after_sigkill(daemon_factory, short_tmp):
    from kvtier.engine.engine import ReferenceEngine
    from kvtier.engine.model import ModelConfig, TinyLlama

    from tests.engines import client_config

    state = short_tmp / "state"
    flags = l3_flags("file", state_dir=str(state), prefetch_threshold="0")
    first = daemon_factory(*flags, name="a")
    pool, conn = engine(first.runtime_dir)
    model = TinyLlama(ModelConfig.tiny())
    vocab = model.cfg.vocab_size
    prompt = np.random.default_rng(7).integers(0, vocab, 6 * 16).tolist()
    made: list[ReferenceEngine] = []
    try:
        keys, expected = store_pages(pool, conn, 8)
        made.append(
            ReferenceEngine(
                mode="on",
                page_size=16,
                num_pages=64,
                model=model,
                client_config=client_config(first.runtime_dir),
            )
        )
        made[-1].generate(prompt, 1)  # its prefill stores 6 pages
        wait_written(first, 8 + 6)
        conn.close()
        first.kill()
        # a new daemon with an empty pool (another pool file), over the same L3 directory
        second = daemon_factory(*flags, name="b")
        conn = Connection(pool, model_id="m", config=client_config(second.runtime_dir))
        assert runs(conn, keys) == (0, 8)
        assert fetch_back(conn, keys) == 8
        load_and_compare(pool, conn, keys, expected)
        # the reference engine computes the same as a full recompute from the L3 pages
        on = ReferenceEngine(
            mode="on",
            page_size=16,
            num_pages=64,
            model=model,
            client_config=client_config(second.runtime_dir),
        )
        off = ReferenceEngine(mode="off", page_size=16, num_pages=64, model=model)
        made += [on, off]
        assert on.connection is not None
        full = prompt + np.random.default_rng(8).integers(0, vocab, 21).tolist()
        prompt_keys = on.connection.page_keys(full)
        assert fetch_back(on.connection, prompt_keys) == 6
        got, want = on.generate(full, 6), off.generate(full, 6)
        assert got.cached_l2 == 6 * 16 and not got.load_failed
        assert got.tokens == want.tokens
        assert float((got.first_logits - want.first_logits).abs().max()) < 1e-4
    finally:
        for e in made:
            e.close()
        conn.close()
        pool.close()


def slow_flags(short_tmp: Path, delay_s: float, put_delay_s: float = 0.0, **more: str) -> list[str]:
    """Flags of a daemon whose L3 is :class:`SlowFileBackend` in ``short_tmp/slow-l3``."""
    extra = {
        "backend_name": "slow-file",
        "module_path": "tests.integration.test_l3_tier",
        "class_name": "SlowFileBackend",
        "path": str(short_tmp / "slow-l3"),
        "delay_s": delay_s,
        "put_delay_s": put_delay_s,
    }
    return l3_flags("dynamic", extra, prefetch_concurrency="1", prefetch_threshold="0", **more)


@pytest.fixture
def slow_daemon(daemon_factory, short_tmp):
    """``make(delay_s, **flags)``: a daemon whose L3 reads each take ``delay_s`` seconds."""

    def make(delay_s: float, **more: str):
        return daemon_factory(*slow_flags(short_tmp, delay_s, **more), env={"PYTHONPATH": REPO})

    return make


def stored_then_evicted(d, n: int) -> tuple[SharedKVPool, Connection, list[bytes], list[bytes]]:
    pool, conn = engine(d.runtime_dir, num_pages=n + 64)
    keys, expected = store_pages(pool, conn, n)
    wait_written(d, n)
    flush(d, "l2")
    return pool, conn, keys, expected


@pytest.mark.timeout(60)
def test_best_effort_returns_at_once_and_cancelled_fills_free_their_slots(slow_daemon):
    delay = 0.5
    d = slow_daemon(delay)
    pool, conn, keys, _ = stored_then_evicted(d, 64)
    try:
        assert conn.prefetch(keys) == 64
        got = conn.claim(keys, policy="best_effort")
        assert got == 0  # the first read is still in flight: best_effort did not wait for it
        # the read in flight finishes, then its slots and all the others are freed
        wait_for(lambda: stats(d)["l3"]["prefetching"] == 0, what="fills to end")
        c, pool_stats = counters(d), stats(d)["pool"]
        assert pool_stats["pages_writing"] == 0 and pool_stats["pages_ready"] == 0
        assert c["l3_prefetch_cancelled_pages"] == 64 and c["l3_prefetch_completed_pages"] == 0
        # the batch read in flight was read, then discarded
        assert c["l3_prefetch_unused_pages"] == read_batch(64, 1)
        assert conn.lookup(keys).l2 == 0
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_timeout_policy_claims_the_batches_read_by_its_deadline(slow_daemon):
    """When the claim ends is tested on a clock the test moves (test_claim_deadline.py);
    here, through a real daemon, what it hands over: whole batches read by then, in chain
    order, loadable, and every other page cancelled."""
    delay, base, per_ki, pages = 0.4, 0.2, 0.1, 256
    d = slow_daemon(
        delay, prefetch_timeout_base=str(base), prefetch_timeout_per_ki_token=str(per_ki)
    )
    pool, conn, keys, expected = stored_then_evicted(d, pages)
    batch = read_batch(pages, 1)  # 4 reads of 64 pages, one at a time: 1.6 s in all
    try:
        deadline = base + per_ki * pages * SMALL.page_size / 1024  # 0.6 s
        assert deadline < 4 * delay  # the claim ends before the last read
        assert conn.prefetch(keys) == pages
        got = conn.claim(keys, policy="timeout")
        assert got % batch == 0 and got < pages, got  # whole batches, in chain order
        load_and_compare(pool, conn, keys[:got], expected[:got], first_page=pages)
        wait_for(lambda: stats(d)["l3"]["prefetching"] == 0, what="fills to end")
        c = counters(d)
        assert c["l3_prefetch_completed_pages"] == got
        assert c["l3_prefetch_cancelled_pages"] == pages - got
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_wait_complete_waits_for_every_page(slow_daemon):
    delay = 0.2
    d = slow_daemon(delay)
    pool, conn, keys, expected = stored_then_evicted(d, 48)
    reads = -(-48 // read_batch(48, 1))  # one at a time
    try:
        assert reads > 1  # the claim waits through several reads
        assert conn.prefetch(keys) == 48
        assert conn.claim(keys, policy="wait_complete") == 48  # every page: it waited
        load_and_compare(pool, conn, keys, expected)
        assert counters(d)["l3_prefetch_cancelled_pages"] == 0
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_flush_l3_deletes_the_callers_pages(daemon_factory):
    d = daemon_factory(*l3_flags("file", prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    pool_b, other = engine(d.runtime_dir, model="other")
    try:
        keys, _ = store_pages(pool, conn, 5)
        keys_b, _ = store_pages(pool_b, other, 3, seed=2)
        wait_written(d, 8)
        with AdminClient(d.endpoint) as admin:  # one namespace, both tiers
            rep = admin.call(P.Flush(req_id=0, tier="all", namespace=conn.ns_fingerprint.hex()))
        assert isinstance(rep, P.FlushReply) and (rep.l2_pages, rep.l3_pages) == (5, 5)
        assert runs(conn, keys) == (0, 0) and runs(other, keys_b) == (3, 0)
        flush(d, "l2")
        assert runs(other, keys_b) == (0, 3)
        rep = flush(d, "l3")
        assert (rep.l2_pages, rep.l3_pages) == (0, 3)
        assert runs(other, keys_b) == (0, 0)
        assert counters(d)["l3_flushed_pages"] == 8
    finally:
        for c in (conn, other):
            c.close()
        pool.close()
        pool_b.close()


@pytest.mark.timeout(90)
def test_write_back_writes_pages_before_their_slots_are_reused(daemon_factory):
    # 8 MiB pool of 32 KiB pages: 256 slots; 20 chains of 32 pages do not fit
    d = daemon_factory(
        *l3_flags("file", prefetch_threshold="0", hicache_write_policy="write_back"),
        "--hicache-size",
        "8MiB",
    )
    pool, conn = engine(d.runtime_dir, num_pages=64)
    chains: list[tuple[list[bytes], list[bytes]]] = []
    try:
        for i in range(20):
            keys = conn.page_keys(tokens(32 * SMALL.page_size, salt=100 + i))
            for p in range(32):
                fill_page(pool, p, seed=i * 100 + p)
            expected = [page_bytes(pool, p) for p in range(32)]

            def stored(keys: list[bytes] = keys) -> bool:
                h = conn.store(keys, list(range(32)))
                return h.wait() and h.count == 32

            wait_for(stored, what=f"chain {i} stored")  # room comes as pages reach L3
            chains.append((keys, expected))
        c = counters(d)
        assert stats(d)["pool"]["evictions"] > 0
        assert c["l3_write_written_pages"] >= stats(d)["pool"]["evictions"]
        for keys, _ in chains:  # each page is in L2 or, after it, in L3
            assert sum(runs(conn, keys)) == 32
        # 640 pages in 256 slots: some chain was evicted, at least in part; the oldest such
        # comes back from L3 (once cold pages are in L3 to make room: a prefetch never
        # waits for room)
        evicted = [(k, e) for k, e in chains if conn.lookup(k).l2 < 32]
        assert evicted, "every chain still whole in L2 after 20 chains in a 256-page pool"
        keys, expected = evicted[0]
        wait_for(lambda: fetch_back(conn, keys) == 32, what="chain 0 back in L2")
        load_and_compare(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()


def _shared_store_roundtrip(a, b, flush_lists: bool = True) -> None:
    pool_a, conn_a = engine(a.runtime_dir)
    pool_b, conn_b = engine(b.runtime_dir)
    try:
        keys, expected = store_pages(pool_a, conn_a, 8)
        wait_written(a, 8)
        assert runs(conn_b, keys) == (0, 8)
        assert fetch_back(conn_b, keys) == 8
        load_and_compare(pool_b, conn_b, keys, expected)
        assert counters(b)["l3_prefetch_completed_pages"] == 8
        if flush_lists:  # B lists the shared store: it deletes the pages A wrote
            assert flush(b, "l3").l3_pages == 8
            flush(a, "l2")
            assert runs(conn_a, keys) == (0, 0)
    finally:
        for c in (conn_a, conn_b):
            c.close()
        pool_a.close()
        pool_b.close()


@pytest.mark.timeout(90)
def test_two_daemons_share_pages_through_redis(redis_server, daemon_factory):
    # the server fixture comes first, so it is torn down after the daemons
    flags = l3_flags("redis", {"url": redis_server.url}, prefetch_threshold="0")
    _shared_store_roundtrip(daemon_factory(*flags, name="a"), daemon_factory(*flags, name="b"))


@pytest.mark.timeout(120)
def test_two_daemons_share_pages_through_mooncake(mooncake_master, daemon_factory):
    # the master fixture comes first, so it is torn down after the daemons
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    flags = l3_flags("mooncake", mooncake_master.extra_config(), prefetch_threshold="0")
    a = daemon_factory(*flags, name="a", env=env)
    b = daemon_factory(*flags, name="b", env=env)
    _shared_store_roundtrip(a, b, flush_lists=False)  # Mooncake cannot list its objects


@pytest.mark.timeout(60)
def test_extra_config_prefetch_keys_override_the_daemon_fields(daemon_factory, short_tmp):
    extra = {"path": str(short_tmp / "l3x"), "prefetch_threshold": 10 * SMALL.page_size}
    d = daemon_factory(*l3_flags("file", extra, prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, _ = store_pages(pool, conn, 8)
        wait_written(d, 8)
        flush(d, "l2")
        assert conn.prefetch(keys) == 0  # 128 tokens < the extra config's 160
        assert (short_tmp / "l3x").is_dir()
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_a_bad_prefetch_key_in_the_extra_config_stops_the_start(daemon_factory, short_tmp):
    from kvtier.launch.daemon_process import DaemonStartError

    d = daemon_factory(
        *l3_flags("file", {"path": str(short_tmp / "l3"), "prefetch_timeout_max": "soon"}),
        start=False,
    )
    with pytest.raises(DaemonStartError, match="prefetch_timeout_max"):
        d.start()


@pytest.mark.timeout(60)
def test_switching_write_back_to_write_through_backs_l2_up(daemon_factory, short_tmp):
    import signal

    conf = short_tmp / "kvtierd.toml"
    conf.write_text('hicache_write_policy = "write_back"\n')
    d = daemon_factory("--config", str(conf), *l3_flags("file", prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, expected = store_pages(pool, conn, 6)  # committed before the STORE is done
        checks = stats(d)["l3"]["write_back_checks"]
        wait_for(
            lambda: stats(d)["l3"]["write_back_checks"] > checks,
            what="write-back to look at the pool after the store",
        )
        assert counters(d)["l3_write_queued_pages"] == 0  # L2 has room: nothing written back
        conf.write_text('hicache_write_policy = "write_through"\n')
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        wait_written(d, 6)
        assert stats(d)["l3"]["write_policy"] == "write_through"
        flush(d, "l2")
        assert fetch_back(conn, keys) == 6
        load_and_compare(pool, conn, keys, expected)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_default_file_path_is_under_the_state_dir(daemon_factory, short_tmp):
    tmp = Path(tempfile.mkdtemp(prefix="kvt-st-", dir=short_tmp))
    e = daemon_factory(*l3_flags("file", state_dir=str(tmp)), name="e")
    assert (tmp / "l3" / "kvtier-file.lock").is_file() and stats(e)["l3"]["healthy"]
    assert not (e.runtime_dir / "state").exists()  # not the runtime dir, usually a tmpfs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["helper", "systemd", "xdg", "home"])
def test_a_daemon_without_l3_flags_keeps_a_file_store_in_its_state_dir(
    case, short_tmp, monkeypatch
):
    """No backend and no state flags: L3 is the file store in ``<state_dir>/l3``, the state dir
    resolved as at a real start (``DaemonProcess`` offers ``<runtime_dir>/state`` as
    ``$STATE_DIRECTORY``, systemd offers its StateDirectory= the same way)."""
    from kvtier.launch.daemon_process import DaemonProcess

    for var in (
        "KVTIER_STATE_DIR",
        "KVTIER_HICACHE_STORAGE_BACKEND",
        "KVTIER_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG",
        "KVTIER_CONFIG",
    ):
        monkeypatch.delenv(var, raising=False)
    rdir, other = short_tmp / "d", short_tmp / "other"
    env, store = {
        "helper": ({}, rdir / "state" / "l3"),
        "systemd": ({"STATE_DIRECTORY": f"{short_tmp / 'sd'}:{other}"}, short_tmp / "sd" / "l3"),
        "xdg": (
            {"STATE_DIRECTORY": "", "XDG_STATE_HOME": str(short_tmp / "xdg")},
            short_tmp / "xdg" / "kvtier" / "l3",
        ),
        "home": (
            {"STATE_DIRECTORY": "", "XDG_STATE_HOME": "", "HOME": str(short_tmp / "h")},
            short_tmp / "h" / ".local" / "state" / "kvtier" / "l3",
        ),
    }[case]
    d = DaemonProcess(rdir, ["--hicache-size", "64MiB", "--extent-size", "4MiB"], env=env)
    try:
        d.start()
        l3 = stats(d)["l3"]
        assert (l3["backend"], l3["healthy"]) == ("file", True)
        assert (store / "kvtier-file.lock").is_file()
        assert not other.exists()  # only the first of several systemd state directories
        if case != "helper":
            assert not (rdir / "state").exists()
    finally:
        d.stop()
        d.remove_pool()


@pytest.mark.timeout(60)
def test_prefetch_skip_leaves_the_leading_keys_to_the_caller(daemon_factory):
    """PREFETCH ``skip``: the first keys are the caller's; neither looked up nor fetched."""
    d = daemon_factory(*l3_flags("file", prefetch_threshold="0"))
    pool, conn = engine(d.runtime_dir)
    try:
        keys, _ = store_pages(pool, conn, 8)
        wait_written(d, 8)
        flush(d, "l2")
        assert conn.prefetch(keys, skip=3) == 5
        conn.claim(keys, policy="wait_complete")
        assert runs(conn, keys[3:]) == (5, 0) and runs(conn, keys) == (0, 8)
    finally:
        conn.close()
        pool.close()


@pytest.mark.timeout(60)
def test_prefetch_coming_counts_the_pages_another_prefetch_brings(slow_daemon):
    """A second engine asking for pages another engine's prefetch is reading is told they
    are coming (its own prefetch starts nothing), and so is one asking once they are in L2:
    what the SGLang backend offers SGLang as a hit."""
    d = slow_daemon(0.5)
    pool, conn, keys, expected = stored_then_evicted(d, 8)
    pool_b, conn_b = engine(d.runtime_dir)
    try:
        assert conn.prefetch(keys) == 8
        assert conn_b.prefetch(keys) == 0  # every page is being read for the first engine
        assert conn_b.prefetch_coming(keys) == 8
        assert conn.claim(keys, policy="wait_complete") == 8
        assert conn_b.prefetch_coming(keys) == 8  # now in L2
        assert conn_b.prefetch_coming(keys, skip=8) == 0
        load_and_compare(pool, conn, keys, expected)
    finally:
        for c in (conn, conn_b):
            c.close()
        for p in (pool, pool_b):
            p.close()
