"""Engine memory described by regions, and control-only sessions, against a real kvtierd.

Engines lay out KV their own way (vLLM's CPU backend: per layer ``[blocks, heads,
block_size, 2 * head_dim]``, K and V interleaved; SGLang's ``page_first``: per component, a
page holds every layer). REGISTER describes any of them as regions; these tests check that
the daemon copies exactly the declared bytes (and nothing between them), that layouts never
share pages, that bad regions are refused naming the field, and that a control-only session
(a scheduler without KV memory) gets LOOKUP answers over every TP rank.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from kvtier.client.connection.connection import Connection, DaemonError
from kvtier.client.kv_pool.regions import ControlOnly, RegionMemory
from kvtier.ipc import protocol as P
from kvtier.ipc.shm import SharedMemorySegment

from tests.engines import client_config, tokens

WAIT_S = 10.0
# a vLLM-CPU-like model: 3 layers, 2 KV heads, block 16, head_dim 32, bf16
VLLM = P.Geometry(
    num_layers=3, page_size=16, kv_heads=2, head_dim=32, dtype="bfloat16", layout="vllm_cpu"
)
PAD = 512  # bytes between blocks that belong to no page (must never be touched)
PAGES = 6


class Engine:
    """An engine whose memory is one memfd laid out per layer, ``[blocks, heads, block,
    2 * dim]`` with ``PAD`` bytes after every block; sealed or not."""

    def __init__(self, geometry: P.Geometry, sealed: bool = True) -> None:
        self.g = geometry
        self.block = 2 * geometry.chunk_bytes  # K and V of one layer's page
        self.stride = self.block + PAD
        self.layer_bytes = PAGES * self.stride
        size = geometry.num_layers * self.layer_bytes
        if sealed:
            self.seg = SharedMemorySegment.create_memfd("kvtier-test-regions", size)
            self.fd = self.seg.fd
        else:
            self.seg = None
            self.fd = os.memfd_create("kvtier-test-unsealed")
            os.ftruncate(self.fd, size)
        self.size = size
        self.regions = [
            P.MemoryRegion(
                segment=0,
                offset=layer * self.layer_bytes,
                page_stride=self.stride,
                page_bytes=self.block,
                layer=layer,
            )
            for layer in range(geometry.num_layers)
        ]

    def memory(self) -> RegionMemory:
        return RegionMemory(self.g, PAGES, [self.fd], [self.size], self.regions)

    def read(self) -> bytes:
        return os.pread(self.fd, self.size, 0)

    def write(self, data: bytes) -> None:
        os.pwrite(self.fd, data, 0)

    def page(self, p: int) -> bytes:
        raw = self.read()
        return b"".join(raw[r.offset + p * r.page_stride :][: r.page_bytes] for r in self.regions)

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
        else:
            os.close(self.fd)


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def connect(daemon):
    opened: list[tuple[Connection, Engine | None]] = []

    def make(mem, engine=None, **kw) -> Connection:
        conn = Connection(mem, model_id="regions", config=client_config(daemon.runtime_dir), **kw)
        opened.append((conn, engine))
        return conn

    yield make
    for conn, eng in opened:
        conn.close()
        if eng is not None:
            eng.close()


@pytest.mark.parametrize("sealed", [True, False], ids=["mapped", "unmapped"])
def test_pages_round_trip_byte_exact_and_nothing_between_them_is_touched(connect, sealed):
    a, b = Engine(VLLM, sealed), Engine(VLLM, sealed)
    ca, cb = connect(a.memory(), a), connect(b.memory(), b)
    a.write(random_bytes(a.size, 1))
    keys = ca.page_keys(tokens(3 * VLLM.page_size, salt=1))
    h = ca.store(keys, [4, 0, 5])
    assert h.wait(WAIT_S) and h.ok
    before = random_bytes(b.size, 2)
    b.write(before)
    assert cb.lookup(keys).l2 == 3
    h = cb.load(keys, [1, 2, 3])
    assert h.wait(WAIT_S) and h.ok
    for src, dst in ((4, 1), (0, 2), (5, 3)):
        assert b.page(dst) == a.page(src), f"engine A page {src} -> engine B page {dst}"
    # every byte outside B's pages 1..3 (other pages, the padding) is as it was
    after = bytearray(b.read())
    for r in b.regions:
        for p in (1, 2, 3):
            start = r.offset + p * r.page_stride
            after[start : start + r.page_bytes] = before[start : start + r.page_bytes]
    assert bytes(after) == before


def test_a_page_first_layout_waits_for_all_layers_and_round_trips(connect):
    """SGLang-like page_first: one region per component, each holding every layer."""
    g = P.Geometry(
        num_layers=3,
        page_size=16,
        kv_heads=2,
        head_dim=32,
        dtype="bfloat16",
        layout="sglang_page_first",
    )
    comp = g.num_layers * g.chunk_bytes
    size = 2 * PAGES * comp
    fd = os.memfd_create("kvtier-test-page-first")
    os.ftruncate(fd, size)
    regions = [
        P.MemoryRegion(segment=0, offset=c * PAGES * comp, page_stride=comp, page_bytes=comp)
        for c in range(2)
    ]
    try:
        conn = connect(RegionMemory(g, PAGES, [fd], [size], regions))
        data = random_bytes(size, 3)
        os.pwrite(fd, data, 0)
        keys = conn.page_keys(tokens(2 * g.page_size, salt=3))
        h = conn.store(keys, [2, 3])
        assert h.wait(WAIT_S) and h.ok
        os.pwrite(fd, bytes(size), 0)
        h = conn.load(keys, [0, 5])
        assert h.wait_layer(0, WAIT_S) and h.wait(WAIT_S) and h.ok
        got = os.pread(fd, size, 0)
        for c in range(2):
            base = c * PAGES * comp
            assert got[base : base + comp] == data[base + 2 * comp : base + 3 * comp]
            assert got[base + 5 * comp : base + 6 * comp] == data[base + 3 * comp : base + 4 * comp]
    finally:
        os.close(fd)


def test_the_layout_label_keeps_layouts_apart(connect):
    a = Engine(VLLM)
    b = Engine(
        P.Geometry(
            **{**{f: getattr(VLLM, f) for f in VLLM.__struct_fields__}, "layout": "vllm_other"}
        )
    )
    ca, cb = connect(a.memory(), a), connect(b.memory(), b)
    keys = ca.page_keys(tokens(VLLM.page_size, salt=4))
    assert ca.store(keys, [0]).wait(WAIT_S)
    assert ca.lookup(keys).l2 == 1
    assert cb.lookup(keys).l2 == 0


def bad(engine: Engine, **change) -> list[P.MemoryRegion]:
    r = engine.regions
    return [
        P.MemoryRegion(**{**{f: getattr(r[0], f) for f in r[0].__struct_fields__}, **change})
    ] + r[1:]


@pytest.mark.parametrize(
    "case,words",
    [
        ("short", ["regions hold", "bytes per page"]),
        ("overrun", ["memory.regions[0]", "overrun segment 0"]),
        ("stride", ["memory.regions[0].page_stride", "smaller than"]),
        ("layer", ["memory.regions[0].layer = 3", "3 layers"]),
        ("segment", ["memory.regions[0].segment = 1", "out of range"]),
        ("both", ["both regions and buffer_offsets"]),
    ],
)
def test_bad_regions_are_refused_naming_the_field(daemon, connect, case, words):
    e = Engine(VLLM)
    mem = e.memory()
    if case == "short":
        regions = bad(e, page_bytes=e.block - 2)
    elif case == "overrun":
        regions = bad(e, offset=e.size - e.block)
    elif case == "stride":
        regions = bad(e, page_stride=e.block - 1)
    elif case == "layer":
        regions = bad(e, layer=3)
    elif case == "segment":
        regions = bad(e, segment=1)
    else:
        regions = e.regions
    export = P.KVMemory(
        kind="fd",
        num_pages=PAGES,
        segments=mem.export().segments,
        regions=regions,
        buffer_offsets=[0] if case == "both" else [],
        buffer_segments=[0] if case == "both" else [],
    )
    mem.export = lambda: export  # type: ignore[method-assign]  (a client sending its own)
    with pytest.raises(DaemonError) as info:
        connect(mem, e)
    assert info.value.code == P.ErrorCode.BAD_MEMORY
    for w in words:
        assert w in str(info.value), str(info.value)
    # the daemon serves on: a good registration works
    good = Engine(VLLM)
    assert connect(good.memory(), good).lookup([b"k" * 32]).l2 == 0


def test_control_only_sessions_answer_each_ranks_lookup_at_once_and_may_not_copy(connect):
    """A TP=2 engine's scheduler: one control session per rank, keys chained from each rank's
    own namespace (as its worker's are); no rank-group round to wait for."""
    ranks = [Engine(VLLM) for _ in range(2)]
    conns = [
        connect(e.memory(), e, tp_rank=r, tp_size=2, register=False) for r, e in enumerate(ranks)
    ]
    for c in conns:
        c.register()
    sched = [connect(ControlOnly(VLLM), tp_rank=r, tp_size=2) for r in range(2)]
    toks = tokens(4 * VLLM.page_size, salt=7)
    keys = [c.page_keys(toks) for c in conns]
    assert keys[0] != keys[1]  # MHA ranks hold different bytes: different chains
    assert [s.page_keys(toks) for s in sched] == keys

    def hit() -> int:
        return min(s.lookup(s.page_keys(toks)).l2 for s in sched)

    assert hit() == 0
    assert conns[0].store(keys[0], [0, 1, 2, 3]).wait(WAIT_S)
    assert [s.lookup(k).l2 for s, k in zip(sched, keys)] == [4, 0]
    assert hit() == 0  # rank 1 has none: the scheduler must not load
    assert conns[1].store(keys[1][:3], [0, 1, 2]).wait(WAIT_S)
    assert hit() == 3
    assert sched[0].store(keys[0], [0]).count == 0  # refused (BAD_MEMORY): dropped like a miss
    assert sched[0].claim(keys[0]) == 0  # refused although its namespace has 4
