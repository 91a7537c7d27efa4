"""While kvtierd starts: the start gate (HEALTH answered, the rest held in order) and the
pool's page tables built after the daemon serves (``populate``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from kvtier.daemon.pool.poolfile import POPULATE_STEP, populate
from kvtier.daemon.service import startgate
from kvtier.daemon.service.startgate import STARTING, StartGate
from kvtier.ipc import protocol as P
from kvtier.ipc.fdpass import PeerCred
from kvtier.ipc.shm import SharedMemorySegment

EPOCH = 0x1234567
GEOMETRY = P.Geometry(num_layers=2, page_size=16, kv_heads=2, head_dim=32, dtype="float16")
PEER = PeerCred(pid=4242, uid=1000, gid=1000)


def register(req_id: int) -> P.Register:
    return P.Register(
        req_id=req_id,
        protocol_version=P.PROTOCOL_VERSION,
        namespace=P.NamespaceSpec(model_id="m"),
        geometry=GEOMETRY,
        memory=P.KVMemory(kind="none", num_pages=1, segments=[]),
    )


def no_peer() -> PeerCred | None:
    raise AssertionError("the sender is asked for a REGISTER only")


def test_health_is_answered_at_once_as_starting():
    gate = StartGate(EPOCH)
    rep = gate.handle(b"id", P.encode(P.Health(req_id=7)), no_peer)
    assert rep == P.HealthReply(
        req_id=7, epoch=EPOCH, status=STARTING, sessions=0, protocol_version=P.PROTOCOL_VERSION
    )
    assert gate.held == []


def test_other_requests_are_held_in_arrival_order_and_released_once():
    gate = StartGate(EPOCH)
    bodies = [
        P.encode(P.Stats(req_id=1)),
        P.encode(P.Heartbeat(req_id=2, session_id=5)),
        b"\xc1 not msgpack",
        P.encode(P.Lookup(req_id=3, session_id=5, keys=[b"k" * 32])),
    ]
    for i, body in enumerate(bodies):
        assert gate.handle(b"id%d" % i, body, no_peer) is None
    assert gate.handle(b"r", P.encode(register(4)), lambda: PEER) is None
    held = gate.release()
    assert [h.identity for h in held] == [b"id0", b"id1", b"id2", b"id3", b"r"]
    assert [h.body for h in held[:4]] == bodies  # undecodable too: the dispatcher refuses it
    assert [h.peer for h in held] == [None, None, None, None, PEER]
    assert gate.release() == [] and gate.held_bytes == 0


def test_past_the_limit_a_request_is_refused_busy_not_dropped(monkeypatch):
    monkeypatch.setattr(startgate, "MAX_HELD", 2)
    gate = StartGate(EPOCH)
    assert gate.handle(b"a", P.encode(P.Stats(req_id=1))) is None
    assert gate.handle(b"b", P.encode(P.Stats(req_id=2))) is None
    rep = gate.handle(b"c", P.encode(P.Stats(req_id=3)))
    assert isinstance(rep, P.ErrorReply) and rep.req_id == 3 and rep.code == P.ErrorCode.BUSY
    assert rep.epoch == EPOCH
    # HEALTH is still answered
    health = gate.handle(b"d", P.encode(P.Health(req_id=4)))
    assert isinstance(health, P.HealthReply) and health.status == STARTING
    assert len(gate.release()) == 2


def test_held_bytes_are_bounded(monkeypatch):
    body = P.encode(P.Stats(req_id=1))
    monkeypatch.setattr(startgate, "MAX_HELD_BYTES", 2 * len(body))
    gate = StartGate(EPOCH)
    assert gate.handle(b"a", body) is None and gate.handle(b"b", body) is None
    rep = gate.handle(b"c", body)
    assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.BUSY


def test_a_message_of_the_wrong_frame_count_is_refused():
    rep = StartGate(EPOCH).refuse_frames(3)
    assert rep.code == P.ErrorCode.BAD_MESSAGE and "got 3" in rep.message


@pytest.fixture
def segment(tmp_path: Path):
    # the pid too: a run that was killed leaves its file, and the next run's tmp_path has the same name
    name = f"kvt-populate-{os.getpid()}-{tmp_path.name}"
    seg = SharedMemorySegment.create(
        Path("/dev/shm") / name, 2 * POPULATE_STEP + 4096, prefault=False
    )
    try:
        yield seg
    finally:
        seg.close(unlink=True)


def resident_bytes(seg: SharedMemorySegment) -> int:
    """Rss of ``seg``'s mapping in this process (``/proc/self/smaps``)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = f"{seg.address:x}-"
    for i, line in enumerate(lines):
        if line.startswith(start):
            rss = next(entry for entry in lines[i + 1 :] if entry.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping at {seg.address:#x}")


def test_populate_maps_every_page_and_leaves_the_bytes(segment):
    arr = segment.array()
    arr[0] = 7
    assert resident_bytes(segment) < segment.size // 2
    assert populate(segment)
    assert resident_bytes(segment) == segment.size
    assert arr[0] == 7 and not arr[1:].any()


def test_populate_stops_when_asked(segment):
    stop = threading.Event()
    stop.set()
    assert not populate(segment, stop.is_set)
    assert resident_bytes(segment) < segment.size // 2
