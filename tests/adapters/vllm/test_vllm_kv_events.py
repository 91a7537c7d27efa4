"""KV events read with vLLM's own types: every batch kvtierd publishes decodes with
``vllm.distributed.kv_events.KVEventBatch``; and a real vLLM (CPU build) started with a KV
events config and the kvtier connector publishes, beside its GPU events, the blocks it can
load from kvtierd, while kvtierd's stream names them with the same hashes and keeps
advertising them after the engine dropped them and after it restarted."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import msgspec
import pytest
import zmq
from kvtier.client.connection.admin import AdminClient
from kvtier.client.connection.events import EventSubscriber
from kvtier.ipc import kv_events as E
from kvtier.ipc import protocol as P
from vllm_harness import BLOCK, EngineProcess, prompt, wait_for_pages

from tests.engines import SMALL, engine, tokens

with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations), not ours
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed import kv_events as V

pytestmark = pytest.mark.timeout(600)

VLLM_DECODER = msgspec.msgpack.Decoder(V.KVEventBatch)


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number that ends a replay's answer (kvtierd's and vLLM's alike)."""


class RawStream:
    """A SUB socket whose batches are decoded by vLLM's decoder only, read from the
    stream's start (sequence 0) without waiting for the subscription to reach the
    publisher: what it misses (sent before the subscription got there, or dropped) comes
    from the publisher's replay socket, as vLLM's own subscriber does it."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.replay_endpoint = replay
        self.next_seq = 0

    def replay(self, upto: int | None = None) -> list[tuple[str, int, V.KVEventBatch]]:
        """The batches from ``next_seq`` (below ``upto``) as the replay socket answers: each
        ``[b"", topic, seq, batch]`` from kvtierd, ``[b"", seq, batch]`` from vLLM."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        out = []
        try:
            req.connect(self.replay_endpoint)
            req.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while True:
                assert req.poll(30_000), f"no answer from {self.replay_endpoint}"
                frames = req.recv_multipart()
                seq, payload = frames[-2], frames[-1]
                if seq == END_SEQ:
                    return out
                n = int.from_bytes(seq, "big")
                if n >= self.next_seq and (upto is None or n < upto):
                    topic = frames[1].decode() if len(frames) == 4 else ""
                    out.append((topic, n, VLLM_DECODER.decode(payload)))
        finally:
            req.close(linger=0)

    def batches(self, quiet_s: float = 2.0) -> list[tuple[str, int, V.KVEventBatch]]:
        """The batches from ``next_seq`` on, until none came for ``quiet_s``: as received,
        gaps filled by replay, then by replay those sent before the subscription reached
        the publisher that no batch received came after."""
        out = []
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            n = int.from_bytes(seq, "big")
            if n < self.next_seq:
                continue  # had it by replay
            if n > self.next_seq:
                out += self.replay(upto=n)
            out.append((topic.decode(), n, VLLM_DECODER.decode(payload)))
            self.next_seq = n + 1
        missed = self.replay()
        if missed:
            self.next_seq = missed[-1][1] + 1
        return out + missed

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def of(batches, kind, medium: str | None = None) -> list:
    return [
        e
        for _, _, b in batches
        for e in b.events
        if isinstance(e, kind) and (medium is None or e.medium == medium)
    ]


def flat(evs) -> list:
    return [h for e in evs for h in e.block_hashes]


def test_every_kvtierd_event_decodes_with_vllms_types(daemon_factory, short_tmp):
    d = daemon_factory(
        "--kv-events-endpoint",
        f"ipc://{short_tmp}/ev.sock",
        "--kv-events-replay-endpoint",
        f"ipc://{short_tmp}/evr.sock",
        "--hicache-storage-backend",
        "file",
        "--hicache-size",
        "8MiB",
        "--extent-size",
        "4MiB",
        "--state-dir",
        str(short_tmp / "st"),
    )
    stream = RawStream(f"ipc://{short_tmp}/ev.sock", f"ipc://{short_tmp}/evr.sock")
    pool, conn = engine(d.runtime_dir, num_pages=200)
    try:
        for c in range(4):  # 800 pages through 512: stores, evictions, L3 writes
            keys = conn.page_keys(tokens(200 * SMALL.page_size, salt=c))
            eng = P.EngineBlocks(
                hashes=[c * 1000 + i for i in range(100)]
                + [bytes([c, i]) * 16 for i in range(100)],
                parent=None,
                token_ids=P.pack_tokens(tokens(200 * 16, c).tolist()),
                lora_name="l" if c else None,
            )
            assert conn.store(keys, list(range(200)), engine=eng).wait()
            with AdminClient(d.endpoint, timeout_s=30.0) as admin:
                # the L3 writes end and drop their pins before the next STORE, so that it
                # evicts (a page being written to L3 is not evicted)
                admin.sync(30.0)
        with AdminClient(d.endpoint, timeout_s=30.0) as admin:
            assert isinstance(admin.call(P.Flush(req_id=0, tier="all")), P.FlushReply)
            c, evictions = admin.stats()["counters"], admin.stats()["pool"]["evictions"]
        got = stream.batches()
        assert got and [s for _, s, _ in got] == list(range(len(got)))
        stored = of(got, V.BlockStored, "CPU")
        assert len(flat(stored)) == c["store_pages"] > 0
        assert len(flat(of(got, V.BlockRemoved, "CPU"))) >= evictions > 0
        assert stored[0].block_hashes[:2] == [0, 1] and stored[0].token_ids[:16] == [
            int(t) for t in tokens(16, 0)
        ]
        assert stored[0].block_size == SMALL.page_size and stored[1].lora_name == "l"
        assert any(isinstance(h, bytes) for h in flat(stored))
        assert of(got, V.BlockStored, "FILE")
        assert of(got, V.AllBlocksCleared)
    finally:
        stream.close()
        conn.close()
        pool.close()


STAGED = {"copy_mode": "engine", "staging_pages": 6}
"""The engine copy mode, its staging area so small that 8 blocks are stored 3 at a time."""


def _engine(
    tiny_model: Path, rdir: Path, log: Path, ev: str, replay: str, extra: dict | None = None
) -> EngineProcess:
    """vLLM with prefix caching, KV events on ``ev`` (replayed on ``replay``) and the
    kvtier connector (``extra``: more of its config); a KV cache of 48 blocks, so a few
    prompts evict the first one's."""
    return EngineProcess(
        tiny_model,
        {"runtime_dir": str(rdir), **(extra or {})},
        log,
        prefix_caching=True,
        kv_bytes=48 * 64 * 1024,
        max_model_len=512,
        kv_events={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": ev,
            "replay_endpoint": replay,
            "topic": "vllm",
        },
    ).wait_ready()


@pytest.mark.parametrize("extra", [{}, STAGED], ids=["daemon-copies", "engine-copies"])
def test_a_vllm_engine_and_kvtierd_advertise_the_same_blocks(
    daemon_factory, short_tmp, tiny_model, extra
):
    d = daemon_factory(
        "--kv-events-endpoint",
        f"ipc://{short_tmp}/kv.sock",
        "--kv-events-replay-endpoint",
        f"ipc://{short_tmp}/kvr.sock",
    )
    node = RawStream(f"ipc://{short_tmp}/kv.sock", f"ipc://{short_tmp}/kvr.sock")
    vl, vlr = f"ipc://{short_tmp}/vl.sock", f"ipc://{short_tmp}/vlr.sock"
    e = _engine(tiny_model, d.runtime_dir, short_tmp / "e0.log", vl, vlr, extra)
    gpu = RawStream(vl, vlr)
    try:
        a = prompt(7, 8 * BLOCK + 1)  # 8 full blocks
        e.generate([a], max_tokens=2)
        wait_for_pages(d.runtime_dir, tiny_model, a[: 8 * BLOCK], 8)
        e.generate([[1, 2, 3]], max_tokens=1)  # a step after the stores ended: their events
        vllm_batches = gpu.batches()
        mine = of(vllm_batches, V.BlockStored, "GPU")
        a_hashes = [h for ev in mine for h in ev.block_hashes][:8]
        assert len(a_hashes) == 8
        # the connector's own events: the same blocks, loadable from kvtierd
        kvtier_stored = of(vllm_batches, V.BlockStored, "KVTIER")
        assert flat(kvtier_stored)[:8] == a_hashes
        # kvtierd's events carry the engine's hashes for the same tokens
        node_stored = of(node.batches(), V.BlockStored, "CPU")
        assert flat(node_stored)[:8] == a_hashes
        for stored in (kvtier_stored, node_stored):  # one event per STORE, chained
            firsts = [ev for ev in stored if set(ev.block_hashes) <= set(a_hashes)]
            assert [t for ev in firsts for t in ev.token_ids] == a[: 8 * BLOCK]
            assert [ev.parent_block_hash for ev in firsts] == [
                None if i == 0 else a_hashes[i - 1]
                for i in itertools.accumulate([0] + [len(ev.block_hashes) for ev in firsts[:-1]])
            ]
            assert len(firsts) == (3 if extra else 1)
        # other prompts fill the engine's 48 blocks: it drops a's blocks from its cache
        for s in range(6):
            e.generate([prompt(100 + s, 12 * BLOCK + 1)], max_tokens=1)
        removed = set(flat(of(gpu.batches(), V.BlockRemoved, "GPU")))
        assert removed & set(a_hashes), "the engine kept a's blocks: no eviction to show"
        node_removed = set(flat(of(node.batches(), V.BlockRemoved)))
        assert not node_removed & set(a_hashes)  # the node still advertises them
        e.close()  # the engine restarts: a router that replays the node's stream knows
        with EventSubscriber(
            f"ipc://{short_tmp}/kv.sock", replay=f"ipc://{short_tmp}/kvr.sock"
        ) as late:
            known = {
                h
                for m in late.replay(0)
                for ev in m.batch.events
                if isinstance(ev, E.BlockStored)
                for h in ev.block_hashes
            }
        assert set(a_hashes) <= known
        vl2, vlr2 = f"ipc://{short_tmp}/vl2.sock", f"ipc://{short_tmp}/vlr2.sock"
        e = _engine(tiny_model, d.runtime_dir, short_tmp / "e1.log", vl2, vlr2, extra)
        out = e.generate([a], max_tokens=2)
        # and the node serves them (a staged load takes at most half the area: 3 pages)
        assert out[0]["cached"] == (3 if extra else 8) * BLOCK
    finally:
        e.close()
        gpu.close()
        node.close()
