"""The wire protocol: every message round-trips; every field a client sends is bounded at
decode, and a value outside its bounds is refused with an error naming the field."""

from __future__ import annotations

import copy
import re
import typing

import msgspec
import numpy as np
import pytest
import zmq
from kvtier.config import DaemonConfig
from kvtier.ipc import limits as L
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import SLOT_WORDS
from kvtier.ipc.sockets import make_zmq_socket

KEY = bytes(range(32))
GEOMETRY = P.Geometry(num_layers=2, page_size=16, kv_heads=2, head_dim=8, dtype="float16")
MEMORY = P.KVMemory(
    kind="shm",
    num_pages=8,
    segments=[P.MemorySegment(name="/dev/shm/kvtier-engine-x", size=1 << 20)],
    buffer_segments=[0, 0, 0, 0],
    buffer_offsets=[0, 4096, 8192, 12288],
)


def requests() -> dict[type, P.Request]:
    """One valid request of every type, every field set."""
    return {
        r.__class__: r
        for r in [
            P.Register(
                req_id=1,
                protocol_version=P.PROTOCOL_VERSION,
                namespace=P.NamespaceSpec(model_id="m", revision="r", cache_salt="s"),
                geometry=GEOMETRY,
                memory=MEMORY,
                tp_rank=1,
                tp_size=2,
                pid=1234,
                tenant="t",
                token="tok",
                tp_group="g",
            ),
            P.Heartbeat(req_id=2, session_id=3),
            P.Lookup(req_id=3, session_id=3, keys=[KEY, KEY[::-1]]),
            P.Store(req_id=4, session_id=3, keys=[KEY], pages=[5], parent_key=KEY, slot=6, seq=7),
            P.Load(req_id=5, session_id=3, keys=[KEY], pages=[5], slot=6, seq=8),
            P.Release(req_id=6, session_id=3, slots=[0, 63]),
            P.Unregister(req_id=7, session_id=3),
            P.Stats(req_id=8, admin_token="a"),
            P.Health(req_id=9),
            P.Flush(req_id=10, admin_token="a", session_id=3, tier="all", namespace="ab" * 32),
            P.Prefetch(req_id=11, session_id=3, keys=[KEY], skip=1, request_id="rq"),
            P.Claim(req_id=12, session_id=3, keys=[KEY], request_id="rq", policy="best_effort"),
            P.Sync(req_id=13, admin_token="a", timeout_s=5.5),
        ]
    }


def replies() -> dict[type, P.Reply]:
    """One reply of every type."""
    e = 0x1234
    return {
        r.__class__: r
        for r in [
            P.Registered(
                req_id=1,
                epoch=e,
                session_id=3,
                lease_s=30.0,
                ns_fingerprint=KEY,
                completion_name="/run/c",
                completion_slots=64,
                daemon_pid=99,
            ),
            P.Ack(req_id=2, epoch=e),
            P.LookupResult(req_id=3, epoch=e, l2=4, l3=5),
            P.StoreAccepted(req_id=4, epoch=e, count=3, writing=2),
            P.LoadAccepted(req_id=5, epoch=e, count=1),
            P.StatsReply(req_id=6, epoch=e, stats={"pool": {"pages_pinned": 0}, "epoch": "ab"}),
            P.HealthReply(req_id=7, epoch=e, status="ok", sessions=2),
            P.FlushReply(req_id=8, epoch=e, l2_pages=9, l3_pages=10),
            P.PrefetchReply(req_id=9, epoch=e, started=11),
            P.ClaimReply(req_id=10, epoch=e, l2=12),
            P.SyncReply(req_id=11, epoch=e, pages=4, written=2, failed=1, left=1),
            P.ErrorReply(req_id=12, epoch=e, code=int(P.ErrorCode.BAD_MESSAGE), message="no"),
        ]
    }


def test_the_samples_cover_every_message_type():
    assert set(requests()) == set(typing.get_args(P.Request))
    assert set(replies()) == set(typing.get_args(P.Reply))


@pytest.mark.parametrize("msg", requests().values(), ids=lambda m: type(m).__name__)
def test_every_request_round_trips(msg):
    assert P.decode_request(P.encode(msg)) == msg


@pytest.mark.parametrize("msg", replies().values(), ids=lambda m: type(m).__name__)
def test_every_reply_round_trips(msg):
    assert P.decode_reply(P.encode(msg)) == msg


def wire(msg: P.Request, path: tuple, value: object) -> bytes:
    """``msg`` encoded with the field at ``path`` (names and list indices) set to ``value``."""
    doc = copy.deepcopy(msgspec.to_builtins(msg, builtin_types=(bytes,)))
    node = doc
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return msgspec.msgpack.encode(doc)


def field_path(path: tuple) -> str:
    """How msgspec names ``path`` in an error: ``$.memory.segments[0].name``."""
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


R = requests()
REG, STORE, LOAD = R[P.Register], R[P.Store], R[P.Load]
BIG = "x" * (1 << 20)
# (message, field path, a value just outside its bounds, the same field's largest valid value)
REGION = {"segment": 0, "offset": 0, "page_stride": 8, "page_bytes": 8, "layer": 0}
"""A valid memory region."""
REG_REGIONS = msgspec.structs.replace(
    REG,
    memory=P.KVMemory(
        kind="fd",
        num_pages=4,
        segments=[P.MemorySegment(name="s", size=1 << 20)],
        regions=[P.MemoryRegion(**REGION)],
    ),
)
"""A REGISTER whose memory is described by regions."""

OUT_OF_RANGE = [
    (R[P.Health], ("req_id",), -1, L.MAX_U63),
    (R[P.Health], ("req_id",), 1 << 63, None),
    (REG, ("pid",), 1 << 31, L.MAX_PID),
    (REG, ("pid",), 1 << 40, None),
    (REG, ("pid",), -1, 0),
    (REG, ("protocol_version",), 1 << 16, None),
    (REG, ("tp_rank",), L.MAX_TP, L.MAX_TP - 1),
    (REG, ("tp_size",), 0, L.MAX_TP),
    (REG, ("tenant",), "t" * (L.MAX_NAME + 1), "t" * L.MAX_NAME),
    (REG, ("token",), BIG, "t" * L.MAX_TEXT),
    (REG, ("tp_group",), "g\x00", "g" * L.MAX_NAME),
    (REG, ("namespace", "model_id"), BIG, "m" * L.MAX_TEXT),
    (REG, ("namespace", "model_id"), "m\x00", None),
    (REG, ("namespace", "revision"), "r" * (L.MAX_NAME + 1), None),
    (REG, ("namespace", "cache_salt"), BIG, None),
    (REG, ("geometry", "num_layers"), 0, L.MAX_LAYERS),
    (REG, ("geometry", "num_layers"), L.MAX_LAYERS + 1, None),
    (REG, ("geometry", "page_size"), L.MAX_DIM + 1, L.MAX_DIM),
    (REG, ("geometry", "kv_heads"), 0, 1),
    (REG, ("geometry", "head_dim"), 1 << 31, None),
    (REG, ("geometry", "dtype"), "float64", "bfloat16"),
    (REG, ("geometry", "attention"), "gqa", "mla"),
    (REG, ("geometry", "layout"), "Page-First", "sglang_page_first"),
    (REG, ("geometry", "layout"), "", "vllm_cpu"),
    (REG, ("geometry", "layout"), "l" * 33, "l" * 32),
    (REG, ("memory", "kind"), "file", "cuda_ipc"),
    (REG, ("memory", "num_pages"), 0, L.MAX_PAGES),
    (REG, ("memory", "num_pages"), L.MAX_PAGES + 1, None),
    (REG, ("memory", "segments"), [{"name": "s", "size": 1}] * (L.MAX_BUFFERS + 1), None),
    (REG, ("memory", "segments", 0, "name"), "/dev/shm/kvtier-engine-\x00x", None),
    (
        REG,
        ("memory", "segments", 0, "name"),
        "n" * (L.MAX_SEGMENT_NAME + 1),
        "n" * L.MAX_SEGMENT_NAME,
    ),
    (REG, ("memory", "segments", 0, "size"), 0, L.MAX_SEGMENT_BYTES),
    (REG, ("memory", "segments", 0, "handle"), b"h" * 65, b"h" * 64),
    (REG, ("memory", "segments", 0, "device_uuid"), "u" * (L.MAX_NAME + 1), None),
    (REG, ("memory", "buffer_segments", 1), -1, L.MAX_BUFFERS - 1),
    (REG_REGIONS, ("memory", "regions", 0, "segment"), -1, L.MAX_BUFFERS - 1),
    (REG_REGIONS, ("memory", "regions", 0, "offset"), L.MAX_SEGMENT_BYTES + 1, L.MAX_SEGMENT_BYTES),
    (REG_REGIONS, ("memory", "regions", 0, "page_stride"), 0, 1),
    (REG_REGIONS, ("memory", "regions", 0, "page_bytes"), 0, L.MAX_SEGMENT_BYTES),
    (REG_REGIONS, ("memory", "regions", 0, "layer"), -2, -1),
    (REG_REGIONS, ("memory", "regions", 0, "layer"), L.MAX_LAYERS, L.MAX_LAYERS - 1),
    (REG_REGIONS, ("memory", "regions"), [REGION] * (L.MAX_BUFFERS + 1), None),
    (REG, ("memory", "buffer_segments"), [0] * (L.MAX_BUFFERS + 1), None),
    (REG, ("memory", "buffer_offsets", 2), -1, L.MAX_SEGMENT_BYTES),
    (REG, ("memory", "buffer_offsets", 2), 1 << 63, None),
    (R[P.Heartbeat], ("session_id",), -5, L.MAX_U63),
    (R[P.Lookup], ("keys", 1), b"k" * 31, None),
    (R[P.Lookup], ("keys", 1), b"k" * 33, b"k" * 32),
    (R[P.Lookup], ("keys",), [KEY] * (L.MAX_KEYS + 1), [KEY] * L.MAX_KEYS),
    (STORE, ("seq",), 1 << 63, L.MAX_U63),
    (STORE, ("seq",), -1, 0),
    (STORE, ("slot",), L.MAX_SLOTS, L.MAX_SLOTS - 1),
    (STORE, ("pages", 0), -1, L.MAX_PAGES - 1),
    (STORE, ("pages", 0), 1 << 40, None),
    (STORE, ("pages",), [0] * (L.MAX_KEYS + 1), None),
    (STORE, ("parent_key",), b"p", None),
    (LOAD, ("seq",), 1 << 63, L.MAX_U63),
    (LOAD, ("slot",), -1, 0),
    (R[P.Release], ("slots", 0), L.MAX_SLOTS, None),
    (R[P.Stats], ("admin_token",), BIG, None),
    (R[P.Flush], ("tier",), "l4", "l3"),
    (R[P.Flush], ("namespace",), "ab" * 31, ""),
    (R[P.Flush], ("namespace",), "zz" * 32, "AB" * 32),
    (R[P.Flush], ("namespace",), "ab" * 32 + "\n", None),
    (R[P.Prefetch], ("skip",), L.MAX_KEYS + 1, L.MAX_KEYS),
    (R[P.Prefetch], ("request_id",), "r" * (L.MAX_NAME + 1), None),
    (R[P.Claim], ("policy",), "eventually", ""),
    (R[P.Sync], ("timeout_s",), 0.0, L.MAX_SYNC_TIMEOUT_S),
    (R[P.Sync], ("timeout_s",), float("nan"), None),
    (R[P.Sync], ("timeout_s",), float("inf"), None),
]


@pytest.mark.parametrize(
    "msg,path,bad,good",
    OUT_OF_RANGE,
    ids=[f"{type(m).__name__}{field_path(p)[1:]}={str(b)[:12]!r}" for m, p, b, _ in OUT_OF_RANGE],
)
def test_out_of_range_fields_are_refused_naming_the_field(msg, path, bad, good):
    with pytest.raises(msgspec.ValidationError) as info:
        P.decode_request(wire(msg, path, bad))
    assert str(info.value).endswith(f"- at `{field_path(path)}`"), info.value
    assert len(str(info.value)) <= L.MAX_ERROR_CHARS
    if good is not None:  # the bound is the right one: its edge is accepted
        back = P.decode_request(wire(msg, path, good))
        node = msgspec.to_builtins(back, builtin_types=(bytes,))
        for step in path:
            node = node[step]
        assert node == good


@pytest.mark.parametrize("value", ["x" * 100_000, "\x00" * 5000])
def test_a_huge_bad_value_is_not_quoted_whole(value):
    with pytest.raises(msgspec.ValidationError) as info:
        P.decode_request(wire(R[P.Flush], ("tier",), value))
    text = str(info.value)
    assert len(text) <= L.MAX_ERROR_CHARS and text.endswith("- at `$.tier`"), text
    assert text.startswith("Invalid enum value")


def test_decode_errors_still_name_wrong_types_and_unknown_ops():
    for doc, words in [
        ({"op": "lookup", "req_id": 1, "session_id": 1, "keys": "x"}, "$.keys"),
        ({"op": "nope", "req_id": 1}, "'nope'"),
        ({"op": "store", "req_id": 1}, "session_id"),
    ]:
        with pytest.raises(msgspec.ValidationError, match=re.escape(words)):
            P.decode_request(msgspec.msgpack.encode(doc))
    with pytest.raises(msgspec.DecodeError):
        P.decode_request(P.encode(R[P.Health])[:-1])


def test_seq_fits_the_completion_block():
    """The largest valid ``seq`` is the largest an int64 word of a completion slot holds."""
    row = np.zeros(SLOT_WORDS, dtype=np.int64)
    row[0] = L.MAX_U63
    assert int(row[0]) == L.MAX_U63
    with pytest.raises(OverflowError):
        row[0] = L.MAX_U63 + 1


def test_geometry_validate_applies_the_wire_bounds_to_python_built_geometries():
    GEOMETRY.validate()
    for change, word in [
        ({"num_layers": 0}, "num_layers"),
        ({"dtype": "float64"}, "dtype"),
        ({"head_dim": L.MAX_DIM + 1}, "head_dim"),
        ({"attention": "mla"}, "must be 1 for MLA"),
    ]:
        bad = msgspec.structs.replace(GEOMETRY, **change)
        with pytest.raises(ValueError, match=word):
            bad.validate()
    assert set(P.DTYPE_SIZES) == set(typing.get_args(L.DType))


def test_the_largest_requests_the_bounds_allow_fit_the_message_limits():
    """A STORE of MAX_KEYS keys and pages, a REGISTER of MAX_BUFFERS buffers and segments,
    every field at its largest, decode, and fit the daemon's default ``max_message_bytes``,
    which is below the transport ceiling (so the daemon answers anything bigger, up to the
    ceiling, with an error naming the limit)."""
    n, text, name = L.MAX_KEYS, "t" * L.MAX_TEXT, "n" * L.MAX_NAME
    store = P.Store(
        req_id=L.MAX_U63,
        session_id=L.MAX_U63,
        keys=[KEY] * n,
        pages=[L.MAX_PAGES - 1] * n,
        parent_key=KEY,
        slot=L.MAX_SLOTS - 1,
        seq=L.MAX_U63,
    )
    seg = P.MemorySegment(
        name="s" * L.MAX_SEGMENT_NAME,
        size=L.MAX_SEGMENT_BYTES,
        handle=b"h" * L.MAX_HANDLE_BYTES,
        device_uuid=name,
    )
    register = P.Register(
        req_id=L.MAX_U63,
        protocol_version=0xFFFF,
        pid=L.MAX_PID,
        tp_rank=L.MAX_TP - 1,
        tp_size=L.MAX_TP,
        tenant=name,
        token=text,
        tp_group=name,
        namespace=P.NamespaceSpec(model_id=text, revision=name, cache_salt=text),
        geometry=P.Geometry(
            num_layers=L.MAX_LAYERS,
            page_size=L.MAX_DIM,
            kv_heads=L.MAX_DIM,
            head_dim=L.MAX_DIM,
            dtype="bfloat16",
        ),
        memory=P.KVMemory(
            kind="cuda_ipc",
            num_pages=L.MAX_PAGES,
            segments=[seg] * L.MAX_BUFFERS,
            buffer_segments=[L.MAX_BUFFERS - 1] * L.MAX_BUFFERS,
            buffer_offsets=[L.MAX_SEGMENT_BYTES] * L.MAX_BUFFERS,
        ),
    )
    default_limit = DaemonConfig.model_fields["max_message_bytes"].default
    assert default_limit < L.MAX_MESSAGE_BYTES
    for msg, under in ((store, 3 << 20), (register, 8 << 20)):  # as ipc/limits.py says
        body = P.encode(msg)
        assert len(body) < min(under, default_limit), (type(msg).__name__, len(body))
        assert P.decode_request(body) == msg


def test_peek_req_id_finds_the_id_of_a_message_too_big_to_decode():
    body = P.encode(P.Lookup(req_id=70_000, session_id=1, keys=[b"k" * 31]))
    assert P.peek_req_id(body) == 70_000
    assert P.peek_req_id(b"\xff\x00") == 0


@pytest.mark.parametrize("socket_type,want", [(zmq.ROUTER, L.MAX_MESSAGE_BYTES), (zmq.DEALER, -1)])
def test_the_daemon_socket_refuses_frames_past_the_ceiling(tmp_path, socket_type, want):
    ctx = zmq.Context()
    try:
        sock = make_zmq_socket(ctx, f"ipc://{tmp_path}/s", socket_type, bind=True)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == want
        sock.close(0)
        sock = make_zmq_socket(
            ctx, f"ipc://{tmp_path}/t", socket_type, bind=True, max_msg_bytes=4096
        )
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 4096
        sock.close(0)
    finally:
        ctx.term()


# -- a CUDA session's event handles in Registered ------------------------------------------------

EVENT_HANDLES = [bytes(64), b"\xff" * 64, bytes(range(64)), bytes([0x00, 0xFF]) * 32]
"""64-byte CUDA IPC event handles, zero and 0xff bytes anywhere (none may be lost or cut)."""


def registered_doc(**fields: object) -> bytes:
    """A Registered reply on the wire with ``fields`` set (encoded as they are)."""
    doc = msgspec.to_builtins(replies()[P.Registered], builtin_types=(bytes,))
    doc.update(fields)
    return msgspec.msgpack.encode(doc)


def test_registered_event_handles_round_trip_byte_for_byte():
    ready = bytes([0xFF, 0x00]) * 32
    msg = msgspec.structs.replace(
        replies()[P.Registered], event_handles=EVENT_HANDLES, ready_event=ready
    )
    back = P.decode_reply(P.encode(msg))
    assert isinstance(back, P.Registered)
    assert back.event_handles == EVENT_HANDLES and back.ready_event == ready
    plain = P.decode_reply(P.encode(replies()[P.Registered]))  # every other session: none
    assert isinstance(plain, P.Registered)
    assert plain.event_handles == [] and plain.ready_event == b""


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"event_handles": [bytes(63)], "ready_event": bytes(64)}, "`$.event_handles[0]`"),
        ({"event_handles": [bytes(65)], "ready_event": bytes(64)}, "`$.event_handles[0]`"),
        (
            {"event_handles": [bytes(64)] * (L.MAX_LAYERS + 1), "ready_event": bytes(64)},
            "`$.event_handles`",
        ),
        ({"event_handles": [bytes(64)], "ready_event": bytes(65)}, "`$.ready_event`"),
        ({"event_handles": [bytes(64)], "ready_event": bytes(63)}, "64-byte CUDA IPC event"),
        ({"event_handles": [bytes(64)]}, "both or neither"),
        ({"ready_event": bytes(64)}, "both or neither"),
        ({"event_handles": ["x" * 64], "ready_event": bytes(64)}, "`$.event_handles[0]`"),
    ],
    ids=["short", "long", "too-many", "ready-long", "ready-short", "no-ready", "no-handles", "str"],
)
def test_registered_event_handles_are_bounded_and_checked(fields, words):
    with pytest.raises(msgspec.ValidationError) as info:
        P.decode_reply(registered_doc(**fields))
    assert words in str(info.value), info.value
    assert len(str(info.value)) <= L.MAX_ERROR_CHARS
