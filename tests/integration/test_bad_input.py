"""Bad input gets an error reply naming the problem; nothing changes; others keep being served."""

from __future__ import annotations

import os

import msgspec
import pytest
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.ipc import protocol as P

from tests.engines import SMALL, engine, fill_page, handover, page_bytes, tokens
from tests.servers import RawDealer

Raw = RawDealer  # sends whatever bytes it is given


@pytest.fixture
def world(daemon):
    """A healthy engine with pages in L2, and a raw socket to misbehave on."""
    pool, conn = engine(daemon.runtime_dir)
    keys = conn.page_keys(tokens(4 * SMALL.page_size))
    for p in range(4):
        fill_page(pool, p, seed=p + 50)
    assert conn.store(keys, [0, 1, 2, 3]).wait()
    raw = Raw(daemon.endpoint)
    yield pool, conn, keys, raw
    raw.close()
    conn.close()
    pool.close()


def still_serving(pool, conn, keys) -> None:
    assert conn.lookup(keys).l2 == 4
    h = conn.load(keys, [10, 11, 12, 13])
    assert h.count == 4 and h.wait()
    assert [page_bytes(pool, p) for p in (10, 11, 12, 13)] == [
        page_bytes(pool, p) for p in range(4)
    ]


def register_msg(pool: SharedKVPool, rdir=None, **over) -> P.Register:
    """A REGISTER of ``pool``, its memory handed over to the daemon in ``rdir`` when given."""
    fields = {
        "req_id": 7,
        "protocol_version": P.PROTOCOL_VERSION,
        "namespace": P.NamespaceSpec("x"),
        "geometry": pool.geometry,
        "memory": pool.export(),
        "pid": os.getpid(),
        "handover": handover(rdir, pool) if rdir is not None else b"",
    }
    fields.update(over)
    return P.Register(**fields)


def expect_error(rep: P.Reply, code: P.ErrorCode, *words: str) -> None:
    assert isinstance(rep, P.ErrorReply), rep
    assert rep.code == code, rep
    for w in words:
        assert w in rep.message, rep.message


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\x00garbage",
        msgspec.msgpack.encode({"op": "nope", "req_id": 3}),
        msgspec.msgpack.encode({"op": "lookup", "req_id": 4, "keys": "x"}),
        msgspec.msgpack.encode([1, 2, 3]),
    ],
)
def test_malformed_messages(world, body):
    pool, conn, keys, raw = world
    expect_error(raw.ask(body), P.ErrorCode.BAD_MESSAGE, "bad message")
    still_serving(pool, conn, keys)


def test_extra_frames_and_oversized(world, daemon):
    pool, conn, keys, raw = world
    expect_error(raw.ask(b"a", b"b"), P.ErrorCode.BAD_MESSAGE, "frames")
    big = P.encode(P.Lookup(req_id=9, session_id=1, keys=[b"k" * 32] * 700_000))
    rep = raw.ask(big)
    expect_error(rep, P.ErrorCode.BAD_MESSAGE, "max_message_bytes")
    assert rep.req_id == 9
    still_serving(pool, conn, keys)


def test_wrong_protocol_version(world):
    pool, conn, keys, raw = world
    with SharedKVPool(SMALL, 4) as other:
        expect_error(
            raw.ask(P.encode(register_msg(other, protocol_version=99))),
            P.ErrorCode.PROTOCOL_VERSION,
            "protocol_version = 99",
        )
    still_serving(pool, conn, keys)


def test_unknown_session(world):
    pool, conn, keys, raw = world
    rep = raw.ask(P.encode(P.Lookup(req_id=5, session_id=12345, keys=keys)))
    expect_error(rep, P.ErrorCode.UNKNOWN_SESSION, "12345")
    # another connection cannot use the healthy engine's session either
    rep = raw.ask(P.encode(P.Lookup(req_id=6, session_id=conn.session_id, keys=keys)))
    expect_error(rep, P.ErrorCode.UNKNOWN_SESSION)
    still_serving(pool, conn, keys)


def test_page_index_out_of_range_and_bad_keys(world, daemon):
    pool, conn, keys, raw = world
    with SharedKVPool(SMALL, 4) as other:
        reg = raw.ask(P.encode(register_msg(other, daemon.runtime_dir)))
        assert isinstance(reg, P.Registered), reg
        sid = reg.session_id
        rep = raw.ask(
            P.encode(P.Load(req_id=1, session_id=sid, keys=keys[:2], pages=[0, 4], slot=0, seq=1))
        )
        expect_error(rep, P.ErrorCode.OUT_OF_RANGE, "pages[1] = 4")
        rep = raw.ask(
            P.encode(P.Store(req_id=2, session_id=sid, keys=keys[:1], pages=[-1], slot=0, seq=1))
        )
        expect_error(rep, P.ErrorCode.BAD_MESSAGE, "$.pages[0]")
        rep = raw.ask(
            P.encode(P.Store(req_id=3, session_id=sid, keys=[b"short"], pages=[0], slot=0, seq=1))
        )
        expect_error(rep, P.ErrorCode.BAD_MESSAGE, "$.keys[0]")
        rep = raw.ask(
            P.encode(P.Store(req_id=4, session_id=sid, keys=keys[:1], pages=[0], slot=999, seq=1))
        )
        expect_error(rep, P.ErrorCode.OUT_OF_RANGE, "slot = 999")
        rep = raw.ask(
            P.encode(P.Load(req_id=5, session_id=sid, keys=keys[:2], pages=[1, 1], slot=0, seq=1))
        )
        expect_error(rep, P.ErrorCode.BAD_MESSAGE, "twice")
        raw.ask(P.encode(P.Unregister(req_id=6, session_id=sid)))
    still_serving(pool, conn, keys)


@pytest.mark.parametrize(
    "change,code,word",
    [
        (
            {
                "geometry": P.Geometry(
                    num_layers=0, page_size=16, kv_heads=2, head_dim=32, dtype="float32"
                )
            },
            P.ErrorCode.BAD_MESSAGE,
            "$.geometry.num_layers",
        ),
        (
            {
                "geometry": P.Geometry(
                    num_layers=4, page_size=16, kv_heads=2, head_dim=32, dtype="float64"
                )
            },
            P.ErrorCode.BAD_MESSAGE,
            "$.geometry.dtype",
        ),
        (
            {
                "geometry": P.Geometry(
                    num_layers=4,
                    page_size=16,
                    kv_heads=2,
                    head_dim=32,
                    dtype="float32",
                    attention="mla",
                )
            },
            P.ErrorCode.GEOMETRY_MISMATCH,
            "kv_heads",
        ),
        (
            {
                "geometry": P.Geometry(
                    num_layers=5, page_size=16, kv_heads=2, head_dim=32, dtype="float32"
                )
            },
            P.ErrorCode.BAD_MEMORY,
            "buffers",
        ),
        (
            {
                "geometry": P.Geometry(
                    num_layers=4, page_size=32, kv_heads=2, head_dim=32, dtype="float32"
                )
            },
            P.ErrorCode.BAD_MEMORY,
            "overrun segment",
        ),
        ({"tp_rank": 2, "tp_size": 2}, P.ErrorCode.GEOMETRY_MISMATCH, "tp_rank"),
    ],
)
def test_geometry_mismatch(world, daemon, change, code, word):
    pool, conn, keys, raw = world
    with SharedKVPool(SMALL, 4) as other:
        expect_error(
            raw.ask(P.encode(register_msg(other, daemon.runtime_dir, **change))), code, word
        )
    still_serving(pool, conn, keys)


def test_memory_by_file_name_is_refused(world, tmp_path):
    """Memory named by a path is refused whatever the path (the daemon opens no file)."""
    pool, conn, keys, raw = world
    with SharedKVPool(SMALL, 4) as other:
        mem = other.export()
        bad = P.KVMemory(
            kind="shm",
            num_pages=4,
            segments=[P.MemorySegment(name="/etc/passwd", size=100)],
            buffer_segments=mem.buffer_segments,
            buffer_offsets=mem.buffer_offsets,
        )
        expect_error(
            raw.ask(P.encode(register_msg(other, memory=bad))),
            P.ErrorCode.BAD_MEMORY,
            "by descriptor",
        )
    still_serving(pool, conn, keys)
