"""What the benchmarks' figures measure: byte checks that see every wrong LOAD, and
baselines that do no more work than the kvtier operation they are set against."""

from __future__ import annotations

import io
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq
from kvtier.bench.scale.baselines import EchoServer
from kvtier.bench.trace import worker as trace_worker
from kvtier.client.connection.request_codec import lookup_request
from kvtier.ipc import protocol as P


class _Handle:
    def __init__(self, count: int) -> None:
        self.count = count
        self.writing = count

    def wait(self) -> bool:
        return True


class _Pool:
    """An engine's KV memory as the trace worker sees it (one layer, 4 KiB pages)."""

    def __init__(self, pages: int) -> None:
        g = trace_worker.GEOMETRY
        shape = (pages, g.page_size, g.kv_heads, g.head_dim)
        self.num_pages = pages
        self.k = [torch.zeros(shape, dtype=torch.float16)]
        self.v = [torch.zeros(shape, dtype=torch.float16)]


class _Daemon:
    """A host pool in a dict; its first ``honest`` LOADs copy, later ones answer the same
    way (every page counted, completion ok) but leave the engine's pages untouched."""

    def __init__(self, kv: _Pool, honest: int) -> None:
        self.kv = kv
        self.held: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.honest = honest
        self.loads = 0

    def lookup(self, keys: list[bytes]) -> SimpleNamespace:
        n = 0
        for k in keys:
            if k not in self.held:
                break
            n += 1
        return SimpleNamespace(l2=n)

    def store(
        self, keys: list[bytes], pages: list[int], parent_key: bytes | None = None
    ) -> _Handle:
        for key, p in zip(keys, pages, strict=True):
            self.held[key] = (self.kv.k[0][p].clone(), self.kv.v[0][p].clone())
        return _Handle(len(keys))

    def load(self, keys: list[bytes], pages: list[int]) -> _Handle:
        self.loads += 1
        if self.loads <= self.honest:
            for key, p in zip(keys, pages, strict=True):
                k, v = self.held[key]
                self.kv.k[0][p] = k
                self.kv.v[0][p] = v
        return _Handle(len(keys))


def test_trace_replay_counts_a_load_that_writes_nothing_as_mismatched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`kvtier bench trace` checks every byte of every LOAD: a LOAD that reports its pages
    landed but writes none of them shows in ``mismatched_bytes``, also when the engine's
    destination pages still hold the same blocks from an earlier LOAD of the same prefix."""
    chains = [[1, 2], [1, 2, 3], [1, 2, 4]]
    kv = _Pool(2 * max(map(len, chains)))
    daemon = _Daemon(kv, honest=1)  # the second request's LOAD copies, the third's does not
    monkeypatch.setattr(sys, "stdin", io.StringIO("go\n"))
    out = trace_worker._replay(daemon, kv, {"chains": chains, "due": [0.0] * len(chains)})
    assert out["hits"] == [0, 2, 2]
    assert daemon.loads == 2
    assert out["mismatched_bytes"] > 0


def test_trace_replay_counts_a_torn_load_as_mismatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LOAD that writes only the first of the two pages it reports is seen: the page it
    left alone counts in ``mismatched_bytes`` whatever the engine's memory held before."""
    chains = [[7, 8], [7, 8, 9], [7, 8, 10]]
    kv = _Pool(2 * max(map(len, chains)))
    daemon = _Daemon(kv, honest=1)

    def torn(keys: list[bytes], pages: list[int]) -> _Handle:
        daemon.loads += 1
        n = len(keys) if daemon.loads <= 1 else 1
        for key, p in zip(keys[:n], pages[:n], strict=True):
            k, v = daemon.held[key]
            kv.k[0][p] = k
            kv.v[0][p] = v
        return _Handle(len(keys))

    daemon.load = torn  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdin", io.StringIO("go\n"))
    out = trace_worker._replay(daemon, kv, {"chains": chains, "due": [0.0] * len(chains)})
    assert out["hits"] == [0, 2, 2]
    assert out["mismatched_bytes"] >= trace_worker.GEOMETRY.page_bytes


def test_lookup_echo_baseline_answers_as_small_as_a_lookup_reply() -> None:
    """The bare echo that LOOKUP round trips are divided by (``lookup_8192_over_echo``,
    ``lookup_throughput_over_echo_8``, ``lookup_over_echo``) carries the LOOKUP's request
    bytes one way and answers with a reply no larger than a LOOKUP's own answer, so the
    baseline moves the same bytes as the LOOKUP it is set against."""
    keys = [i.to_bytes(32, "little") for i in range(8192)]
    request = P.encode(lookup_request(1, keys, True))
    answer = P.encode(P.LookupResult(req_id=1 << 40, epoch=1 << 40, l2=8192, l3=8192))
    with (
        tempfile.TemporaryDirectory(prefix="kvt-echo-", dir="/tmp") as d,
        EchoServer(Path(d)) as echo,
    ):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(echo.endpoint)
            sock.send(request)
            assert sock.poll(10_000), "the echo server did not answer"
            reply = sock.recv()
        finally:
            sock.close(0)
            ctx.term()
    assert len(request) > 8192 * 32
    assert len(reply) <= len(answer)
