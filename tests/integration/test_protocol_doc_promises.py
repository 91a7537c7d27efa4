"""What docs/protocol.md and docs/configuration.md promise an engine or client author,
against a real kvtierd: a RELEASE of a slot outside the completion block, a small copy's
slot at reply time, the encoded size of the largest valid REGISTER, and the client's
``tp_group`` bound."""

from __future__ import annotations

import os
import secrets

import pytest
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ConfigError, client_config
from kvtier.ipc import protocol as P
from kvtier.ipc.completion import CompletionBlock, TransferStatus
from kvtier.ipc.fdpass import hand_over, handover_path
from kvtier.ipc.geometry import MemoryRegion, MemorySegment
from kvtier.ipc.limits import HANDOVER_TOKEN_BYTES, MAX_BUFFERS

from tests.engines import SMALL
from tests.servers import RawDealer


def _raw_session(d, geometry: P.Geometry, num_pages: int = 4):
    """A raw DEALER with a session registered over a fresh pool, and the session's completion
    block mapped as the engine maps it (caller closes pool, block and dealer)."""
    pool = SharedKVPool(geometry, num_pages)
    token = secrets.token_bytes(HANDOVER_TOKEN_BYTES)
    fd = hand_over(handover_path(d.runtime_dir), token, pool.memory_fds(), 5.0)
    try:
        block = CompletionBlock.from_fd(fd, 64)
    finally:
        os.close(fd)
    raw = RawDealer(d.endpoint)
    rep = raw.ask(
        P.encode(
            P.Register(
                req_id=1,
                protocol_version=P.PROTOCOL_VERSION,
                namespace=P.NamespaceSpec("review"),
                geometry=geometry,
                memory=pool.export(),
                pid=os.getpid(),
                handover=token,
            )
        )
    )
    assert isinstance(rep, P.Registered), rep
    return pool, block, raw, rep


# ------------------------------------------------------------------ RELEASE's slots
def test_release_of_a_slot_outside_the_completion_block_is_out_of_range(daemon):
    """docs/protocol.md, "Field bounds": "`slot`, `slots[i]` | 0 … 65,535 (and below the
    completion block's 64 slots)", and "Bounds in parentheses depend on the daemon's
    configuration or on the session; the handler checks them and answers `BAD_MESSAGE`,
    `OUT_OF_RANGE` or `GEOMETRY_MISMATCH`"; "Error codes": "4 | OUT_OF_RANGE | ... a
    transfer slot outside the block". RELEASE is refused for such a slot as STORE and LOAD
    are."""
    pool, block, raw, reg = _raw_session(daemon, SMALL)
    try:
        # the same slot in a STORE is refused, as documented
        store = raw.ask(
            P.encode(
                P.Store(
                    req_id=2,
                    session_id=reg.session_id,
                    keys=[secrets.token_bytes(32)],
                    pages=[0],
                    slot=reg.completion_slots,
                    seq=1,
                )
            )
        )
        assert isinstance(store, P.ErrorReply) and store.code == P.ErrorCode.OUT_OF_RANGE, store
        for slot in (reg.completion_slots, 65535):
            rep = raw.ask(P.encode(P.Release(req_id=3, session_id=reg.session_id, slots=[slot])))
            assert isinstance(rep, P.ErrorReply), (
                f"RELEASE of slot {slot} of a {reg.completion_slots}-slot completion block "
                f"was answered {rep!r}, not OUT_OF_RANGE"
            )
            assert rep.code == P.ErrorCode.OUT_OF_RANGE, rep
    finally:
        raw.close()
        block.close()
        pool.close()


# ------------------------------------------------------------------ a small copy is DONE at reply
G40 = P.Geometry(num_layers=40, page_size=16, kv_heads=2, head_dim=32, dtype="float16")
G500 = P.Geometry(num_layers=500, page_size=1, kv_heads=1, head_dim=8, dtype="uint8")
TRIES = 16


@pytest.mark.parametrize(
    ("geometry", "flags"),
    [(SMALL, ("--native-off", '["region_copy"]')), (G40, ()), (G500, ())],
    ids=["8-regions-region_copy-off", "80-regions", "1000-regions"],
)
def test_a_store_of_at_most_256_kib_is_done_when_its_reply_arrives(daemon_factory, geometry, flags):
    """docs/protocol.md, "Completion block": a copy of at most 256 KiB is done on the event
    loop before the reply, for a session whose pages are at most 64 regions (1,024 with the
    native region copy): its slot already says DONE when the engine reads the reply."""
    assert geometry.page_bytes <= 256 << 10
    d = daemon_factory(*flags)
    pool, block, raw, reg = _raw_session(d, geometry, num_pages=TRIES)
    try:
        seen = []
        for i in range(TRIES):  # one STORE per slot and page; each must be DONE at its reply
            rep = raw.ask(
                P.encode(
                    P.Store(
                        req_id=2 + i,
                        session_id=reg.session_id,
                        keys=[secrets.token_bytes(32)],
                        pages=[i],
                        slot=i,
                        seq=100 + i,
                    )
                )
            )
            assert isinstance(rep, P.StoreAccepted) and rep.writing == 1, rep
            seq, layers, status = block.read(i)  # right after the reply, as an engine would
            assert seq == 100 + i, (seq, layers, status)
            seen.append((TransferStatus(status).name, layers))
        late = [s for s in seen if s[0] != "DONE"]
        assert not late, (
            f"{len(late)} of {TRIES} one-page STOREs of {geometry.page_bytes} bytes were not "
            f"DONE when their reply arrived: (status, layers done of {geometry.num_layers}) "
            f"{late[:4]}"
        )
    finally:
        raw.close()
        block.close()
        pool.close()


# ------------------------------------------------------------------ the largest valid REGISTER
def _largest_register(char: str) -> P.Register:
    """A REGISTER with every list at its longest and every string at its longest (in
    characters, as the bounds count them) made of ``char``."""
    n = MAX_BUFFERS
    seg = MemorySegment(name=char * 512, size=1 << 48, handle=b"h" * 64, device_uuid=char * 256)
    region = MemoryRegion(
        segment=n - 1, offset=1 << 48, page_stride=1 << 48, page_bytes=1 << 48, layer=4095
    )
    memory = P.KVMemory(
        kind="cuda_ipc",
        num_pages=1 << 26,
        segments=[seg] * n,
        buffer_segments=[n - 1] * n,
        buffer_offsets=[1 << 48] * n,
        regions=[region] * n,
    )
    geometry = P.Geometry(
        num_layers=4096,
        page_size=1 << 20,
        kv_heads=1 << 20,
        head_dim=1 << 20,
        dtype="bfloat16",
        layout="a" * 32,
    )
    return P.Register(
        req_id=(1 << 63) - 1,
        protocol_version=P.PROTOCOL_VERSION,
        namespace=P.NamespaceSpec(
            model_id=char * 4096, revision=char * 256, cache_salt=char * 4096
        ),
        geometry=geometry,
        memory=memory,
        tp_rank=1023,
        tp_size=1024,
        pid=1 << 22,
        tenant=char * 256,
        token=char * 4096,
        tp_group=char * 256,
        handover=secrets.token_bytes(HANDOVER_TOKEN_BYTES),
        counts_continue=True,
    )


@pytest.mark.timeout(120)
def test_the_largest_register_the_field_bounds_allow(daemon):
    """docs/protocol.md, "Transport": the largest request the field bounds allow (a REGISTER
    of 8,192 segments, every string at its longest in ASCII) encodes to under 8 MiB; with
    4-byte UTF-8 characters it is about 26 MiB, which a daemon at the default
    ``max_message_bytes`` refuses naming the limit, and goes on serving."""
    assert len(P.encode(_largest_register("x"))) < 8 << 20
    body = P.encode(_largest_register("\U0001f600"))
    P.decode_request(body)  # within every field bound: the decoder takes it
    assert 24 << 20 < len(body) < 28 << 20
    raw = RawDealer(daemon.endpoint, wait_s=30.0)
    try:
        rep = raw.ask(body)
        assert isinstance(rep, P.ErrorReply) and rep.code == P.ErrorCode.BAD_MESSAGE, rep
        assert "max_message_bytes" in rep.message, rep
        health = raw.ask(P.encode(P.Health(req_id=7)))
        assert isinstance(health, P.HealthReply), health
    finally:
        raw.close()


# ------------------------------------------------------------------ ClientConfig.tp_group
def test_client_tp_group_over_256_characters_is_a_config_error_naming_the_key():
    """docs/configuration.md, "Engines (`ClientConfig`)": "`tp_group` | `""` | names this
    engine's tensor-parallel rank group (at most 256 characters)"; and "An unknown key or a
    bad value stops the program with a message naming the key, its source and the value"
    (not a REGISTER refused naming the wire field ``$.tp_group``)."""
    with pytest.raises(ConfigError, match="tp_group"):
        client_config({"tp_group": "g" * 257}, source="the engine's kvtier settings")
