"""Tensor-parallel rank groups against a real kvtierd: every rank of an engine gets the
minimum over the ranks, a rank that never asks makes the answer 0 (never a hang), and MLA
ranks share rank 0's pages."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P

from tests.engines import SMALL, client_config, fill_page, page_bytes, tokens

T = TypeVar("T")
MLA = P.Geometry(
    num_layers=4, page_size=16, kv_heads=1, head_dim=64, dtype="float16", attention="mla"
)


class Ranks:
    """The ranks of one TP engine in this process: a pool and a connection per rank."""

    def __init__(
        self,
        rdir,
        geometry: P.Geometry = SMALL,
        tp_size: int = 2,
        model: str = "tp-model",
        group: str = "",
    ) -> None:
        self.pools: list[SharedKVPool] = []
        self.conns: list[Connection] = []
        self._pool = ThreadPoolExecutor(tp_size)
        for rank in range(tp_size):
            self.pools.append(SharedKVPool(geometry, 64))
            self.conns.append(
                Connection(
                    self.pools[-1],
                    model_id=model,
                    config=client_config(rdir, tp_group=group),
                    tp_rank=rank,
                    tp_size=tp_size,
                )
            )

    def each(self, fn: Callable[[int], T]) -> list[T]:
        """Run ``fn(rank)`` on every rank at once (ranks are separate processes in real life)."""
        return list(self._pool.map(fn, range(len(self.conns))))

    def keys(self, pages: int, salt: int = 0) -> list[list[bytes]]:
        """Each rank's keys for the same tokens (MHA ranks differ: the rank is in the namespace)."""
        return [c.page_keys(tokens(pages * SMALL.page_size, salt=salt)) for c in self.conns]

    def store(self, rank: int, keys: list[bytes], seed: int = 1) -> list[bytes]:
        pool = self.pools[rank]
        for p in range(len(keys)):
            fill_page(pool, p, seed=seed * 100 + rank * 10 + p)
        h = self.conns[rank].store(keys, list(range(len(keys))))
        assert h.wait() or h.writing == 0
        return [page_bytes(pool, p) for p in range(len(keys))]

    def close(self) -> None:
        for c in self.conns:
            c.close()
        for p in self.pools:
            p.close()
        self._pool.shutdown()


@pytest.fixture
def ranks_factory() -> Iterator[Callable[..., Ranks]]:
    made: list[Ranks] = []

    def make(*args, **kw) -> Ranks:
        made.append(Ranks(*args, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def counters(daemon) -> dict[str, int]:
    with AdminClient(daemon.endpoint, timeout_s=5.0) as admin:
        return admin.stats()["counters"]  # type: ignore[return-value]


def runs(conn: Connection, keys: list[bytes]) -> tuple[int, int]:
    r = conn.lookup(keys)
    return r.l2, r.l3


@pytest.mark.timeout(60)
def test_a_rank_missing_a_page_gives_both_ranks_the_shorter_run(daemon, ranks_factory):
    ranks = ranks_factory(daemon.runtime_dir)
    keys = ranks.keys(4)
    ranks.store(0, keys[0])
    ranks.store(1, keys[1][:3])  # rank 1 lacks the last page
    assert ranks.each(lambda r: runs(ranks.conns[r], keys[r])) == [(3, 0), (3, 0)]
    assert ranks.each(lambda r: ranks.conns[r].claim(keys[r])) == [3, 3]
    c = counters(daemon)
    assert c["tp_rounds"] == 2 and c["tp_round_timeouts"] == 0
    assert c["lookup_hit_keys"] == 3 + 3  # each rank counts the run it was answered


@pytest.mark.timeout(60)
def test_l3_runs_prefetch_and_claim_agree_over_the_group(daemon_factory, ranks_factory):
    d = daemon_factory("--hicache-storage-backend", "file", "--prefetch-threshold", "0")
    ranks = ranks_factory(d.runtime_dir)
    keys = ranks.keys(6)
    expected = [ranks.store(0, keys[0]), ranks.store(1, keys[1][:4])]

    def in_l3() -> bool:
        return counters(d)["l3_write_written_pages"] >= 10

    deadline = time.monotonic() + 20
    while not in_l3():
        assert time.monotonic() < deadline, "pages did not reach L3"
        time.sleep(0.02)
    with AdminClient(d.endpoint) as admin:
        assert isinstance(admin.call(P.Flush(req_id=0, tier="l2")), P.FlushReply)
    assert ranks.each(lambda r: runs(ranks.conns[r], keys[r])) == [(0, 4), (0, 4)]
    assert ranks.each(lambda r: ranks.conns[r].prefetch(keys[r])) == [6, 4]
    assert ranks.each(lambda r: ranks.conns[r].claim(keys[r], policy="wait_complete")) == [4, 4]
    for r in range(2):  # each rank loads its own 4 pages
        h = ranks.conns[r].load(keys[r][:4], [40, 41, 42, 43])
        assert h.count == 4 and h.wait()
        assert [page_bytes(ranks.pools[r], p) for p in (40, 41, 42, 43)] == expected[r][:4]


@pytest.mark.timeout(60)
def test_a_rank_that_never_asks_makes_the_answer_zero_after_the_deadline(
    daemon_factory, ranks_factory
):
    group_s, storage_s = 0.5, 0.2
    d = daemon_factory("--tp-group-timeout-s", str(group_s), "--storage-timeout-s", str(storage_s))
    ranks = ranks_factory(d.runtime_dir)
    keys = ranks.keys(4)
    ranks.store(0, keys[0])
    ranks.store(1, keys[1][:3])
    assert runs(ranks.conns[0], keys[0]) == (0, 0)  # rank 1 never asked: 0, not a hang
    assert counters(d)["tp_round_timeouts"] == 1  # the round ended at its deadline
    # rank 1 asks late: that round is over, the same answer without a round of its own
    assert runs(ranks.conns[1], keys[1]) == (0, 0)
    assert counters(d)["tp_round_timeouts"] == 1
    # the ranks are in step again
    assert ranks.each(lambda r: runs(ranks.conns[r], keys[r])) == [(3, 0), (3, 0)]
    assert counters(d)["tp_round_timeouts"] == 1


@pytest.mark.timeout(60)
def test_a_restarted_rank_falls_into_step(daemon, ranks_factory):
    ranks = ranks_factory(daemon.runtime_dir)
    keys = ranks.keys(4)
    ranks.store(0, keys[0])
    ranks.store(1, keys[1])
    for _ in range(3):
        assert ranks.each(lambda r: runs(ranks.conns[r], keys[r])) == [(4, 0), (4, 0)]
    ranks.conns[1].close()  # rank 1 restarts: a new session joins at the next round
    ranks.conns[1] = Connection(
        ranks.pools[1],
        model_id="tp-model",
        config=client_config(daemon.runtime_dir),
        tp_rank=1,
        tp_size=2,
    )
    assert ranks.each(lambda r: runs(ranks.conns[r], keys[r])) == [(4, 0), (4, 0)]
    assert counters(daemon)["tp_round_timeouts"] == 0


@pytest.mark.timeout(60)
def test_engines_with_distinct_group_names_do_not_wait_for_each_other(daemon, ranks_factory):
    x = ranks_factory(daemon.runtime_dir, group="x")
    y = ranks_factory(daemon.runtime_dir, group="y")
    keys = x.keys(2)
    x.store(0, keys[0])
    x.store(1, keys[1])
    assert x.each(lambda r: runs(x.conns[r], keys[r])) == [(2, 0), (2, 0)]
    assert y.each(lambda r: runs(y.conns[r], keys[r])) == [(2, 0), (2, 0)]  # same namespace
    assert counters(daemon)["tp_round_timeouts"] == 0


@pytest.mark.timeout(60)
def test_mla_only_rank_0_stores_and_every_rank_loads_its_pages(daemon, ranks_factory):
    ranks = ranks_factory(daemon.runtime_dir, geometry=MLA)
    keys = ranks.keys(3)
    assert keys[0] == keys[1]  # MLA namespaces leave the rank out
    h = ranks.conns[1].store(keys[1], [0, 1, 2])
    assert (h.count, h.writing) == (3, 0)  # a no-op success
    assert counters(daemon)["store_pages"] == 0
    expected = ranks.store(0, keys[0])
    assert counters(daemon)["store_pages"] == 3
    assert ranks.each(lambda r: runs(ranks.conns[r], keys[r])) == [(3, 0), (3, 0)]
    for r in range(2):
        h = ranks.conns[r].load(keys[r], [50, 51, 52])
        assert h.count == 3 and h.wait()
        assert [page_bytes(ranks.pools[r], p) for p in (50, 51, 52)] == expected
