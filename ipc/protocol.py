"""The kvtier wire protocol: every control message, error code and the protocol version.

Nothing else in kvtier builds frames by hand. Messages are msgspec structs encoded with
MessagePack; each request carries a request id that its reply echoes, and each reply
carries the daemon's epoch (new per boot) so a client notices a restarted daemon.

Frames on the wire (client DEALER → daemon ROUTER)::

    client sends:   [body]                  body = msgpack(Request)
    daemon sees:    [identity, body]
    daemon replies: [identity, body]        body = msgpack(Reply)

Page bytes never travel here: STORE and LOAD name pages by index; the daemon copies them
through shared memory (or CUDA IPC) and signals completion in a per-session completion
block (:mod:`kvtier.ipc.completion`). Memory itself never travels by name either: before
REGISTER the engine hands its descriptors over on the daemon's handover socket
(:mod:`kvtier.ipc.fdpass`) and REGISTER names the handover's token.

Every request field is typed with its wire bounds (:mod:`kvtier.ipc.limits`): choices are
``Literal``, numbers and lengths carry ``msgspec.Meta`` ranges, keys are 32 bytes, strings
hold no NUL. :func:`decode_request` refuses a value outside them, naming the field, before
the daemon acts on the request. Structs built in Python are not checked (msgspec checks at
decode), so a client can still build, and a test still send, a request the daemon refuses.
"""

from __future__ import annotations

import enum

import msgspec
from kvtier.ipc.geometry import (  # re-exported: P.Geometry, P.KVMemory, ...
    DTYPE_SIZES,  # noqa: F401
    Geometry,
    KVMemory,
    MemoryRegion,  # noqa: F401
    MemorySegment,  # noqa: F401
)
from kvtier.ipc.limits import (
    KEY_BYTES,
    MAX_ERROR_CHARS,
    MAX_HANDLE_BYTES,
    U63,
    BlockHash,
    BlockHashes,
    BlockSize,
    ClaimPolicy,
    Fingerprint,
    FlushTier,
    EventHandles,
    HandoverToken,
    Key,
    Keys,
    Name,
    OptionalEventHandle,
    PackedKeys,
    PackedPages,
    PackedTokens,
    Pages,
    Pid,
    ProtocolVersion,
    Skip,
    Slot,
    Slots,
    SyncTimeout,
    Text,
    TpRank,
    TpSize,
)
from kvtier.ipc.packed import (  # re-exported: P.pack_keys, P.PackedKeyList, ...
    PackedKeyList,  # noqa: F401
    pack_keys,  # noqa: F401
    pack_pages,  # noqa: F401
    pack_tokens,  # noqa: F401
    split_keys,
)

PROTOCOL_VERSION = 2
"""The protocol this build speaks (REGISTER's ``protocol_version``; HEALTH tells it).

1. The first: engine memory named by path, then handed over as descriptors on the
   handover socket; LOAD/STORE without ``deadline_ns``, PREFETCH's reply without
   ``coming``.
2. A client counts on the daemon honouring LOAD's and STORE's ``deadline_ns`` (an
   unanswered LOAD's pages are the engine's again: a daemon that ignored it could copy
   into them later) and on PREFETCH's reply saying what is ``coming``.

A daemon serves clients of every version in :data:`SERVED_PROTOCOL_VERSIONS` (an older
client never sends what it does not know, and the daemon answers it as it expects); a
client registers only with a daemon of its own version, which refuses it otherwise
(PROTOCOL_VERSION, naming both), so upgrade kvtierd before the engines."""
SERVED_PROTOCOL_VERSIONS = frozenset({1, 2})
"""Versions of the clients a daemon of this build registers."""


class ErrorCode(enum.IntEnum):
    """Why a request was refused. Every error reply carries one."""

    BAD_MESSAGE = 1  # not decodable, wrong types, a field out of its bounds, oversized
    PROTOCOL_VERSION = 2  # REGISTER with another protocol version
    UNKNOWN_SESSION = 3  # session id not (or no longer) registered by this daemon epoch
    OUT_OF_RANGE = 4  # page index or transfer slot outside the registered memory
    GEOMETRY_MISMATCH = 5  # geometry / memory description inconsistent
    UNAUTHORIZED = 6  # missing or wrong tenant token / admin credential
    BAD_MEMORY = (
        7  # no (or a spent) handover, a descriptor unsealed / of the wrong size, not mappable
    )
    BUSY = 8  # a limit was reached (sessions, transfer slot in use)
    SHUTTING_DOWN = 9  # the daemon is stopping
    INTERNAL = 10  # a bug in the daemon; the request had no effect


class NamespaceSpec(msgspec.Struct, frozen=True):
    """What, beside the geometry, makes KV bytes interchangeable (ARCHITECTURE §4)."""

    model_id: Text
    revision: Name = ""
    cache_salt: Text = ""


class _Req(msgspec.Struct, tag_field="op", kw_only=True):
    req_id: U63


class Register(_Req, tag="register", kw_only=True):
    """Start a session: geometry, namespace and exported memory; answered by :class:`Registered`.

    The ranks of one tensor-parallel engine (``tp_size`` > 1) form a group: same tenant,
    model id, revision, cache salt, attention kind, ``tp_size`` and ``tp_group``. LOOKUP
    and CLAIM answer every rank of a group with the minimum over its ranks. ``tp_group``
    tells apart engines that share everything else on one node (empty by default).
    ``counts_continue``: the connection counted LOOKUPs or CLAIMs (``round``) before this
    registration and its counts go on from there (a session that ended while its process
    was stopped, a daemon restart); a new connection counts from 1.
    """

    protocol_version: ProtocolVersion
    namespace: NamespaceSpec
    geometry: Geometry
    memory: KVMemory
    tp_rank: TpRank = 0
    tp_size: TpSize = 1
    pid: Pid = 0
    tenant: Name = "default"
    token: Text = ""
    tp_group: Name = ""
    handover: HandoverToken = b""
    counts_continue: bool = False


class Heartbeat(_Req, tag="heartbeat", kw_only=True):
    """Renew the session's lease."""

    session_id: U63


class Lookup(_Req, tag="lookup", kw_only=True):
    """How long is the leading run of the keys in L2 (and then in L3)?

    The keys come as ``keys`` (a list) or, when the daemon's :class:`Registered` said
    ``packed_lookup``, as ``packed_keys``: the 32-byte keys back to back in one byte string
    (:func:`pack_keys`), much cheaper to encode and decode for long contexts. A request
    carrying both is refused (``BAD_MESSAGE``); so is ``packed_keys`` of a length that is
    not a multiple of 32.
    """

    session_id: U63
    keys: Keys = []
    packed_keys: PackedKeys = b""  # type: ignore[assignment]  # bytes to send, a view decoded
    round: U63 = 0  # a TP rank's count of its LOOKUPs, this one included (0: not counted)

    def key_count(self) -> int:
        """How many keys the request carries (in either form; a partial one counts)."""
        return len(self.keys) + -(-len(self.packed_keys) // KEY_BYTES)

    def key_list(self) -> list[bytes]:
        """The keys as a list, in either form."""
        return self.keys if not self.packed_keys else split_keys(self.packed_keys)


class EngineBlocks(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the engine itself names the pages of a STORE, for the KV events kvtierd publishes
    (routers match events against the hashes they compute for a request).

    Attributes:
        hashes: the engine's hash of each page, one per key, in key order (vLLM's
            ``ExternalBlockHash``: an int, or bytes).
        parent: the engine's hash of the block before ``hashes[0]`` (None: chain start).
        token_ids: the pages' tokens, ``block_size`` per page, packed (:func:`pack_tokens`:
            little-endian uint32 each), or empty.
        block_size: tokens per engine block (None: the session's page size).
        lora_name: the LoRA adapter the blocks were computed with, if any.
    """

    hashes: BlockHashes
    parent: BlockHash | None = None
    token_ids: PackedTokens = b""
    block_size: BlockSize | None = None
    lora_name: Name | None = None


class Store(_Req, tag="store", kw_only=True):
    """Copy engine pages ``pages[i]`` into L2 under ``keys[i]`` where L2 lacks them.

    ``parent_key`` is the key before ``keys[0]`` in its chain (None for a chain start).
    The daemon signals completion in transfer slot ``slot`` tagged with ``seq``. The keys
    and pages may come packed instead, as for :class:`Load`. ``engine``: the engine's own
    block hashes (sent only to a daemon whose :class:`Registered` says ``kv_events``).
    ``deadline_ns``: as for :class:`Load`.
    """

    session_id: U63
    keys: Keys = []
    pages: Pages = []
    packed_keys: PackedKeys = b""  # type: ignore[assignment]  # bytes to send, a view decoded
    packed_pages: PackedPages = b""  # type: ignore[assignment]
    parent_key: Key | None = None
    slot: Slot
    seq: U63
    engine: EngineBlocks | None = None
    deadline_ns: U63 = 0


class Load(_Req, tag="load", kw_only=True):
    """Pin the leading L2 run of ``keys`` and copy it into engine pages, layer by layer.

    The keys and pages come as lists (``keys``, ``pages``) or, when the daemon's
    :class:`Registered` said ``packed_transfers``, packed: ``packed_keys`` as for
    :class:`Lookup` and ``packed_pages``, the page indices as little-endian uint32 back to
    back (:func:`pack_pages`), one per key. A 128K-token context's 8,192 keys and pages
    are then two byte strings instead of 16,384 objects to encode, decode and check. A
    request mixing the two forms is refused (``BAD_MESSAGE``), as is a packed one whose
    lengths do not make whole keys with one page each.

    ``deadline_ns``: when the engine stops waiting for the reply, in ``CLOCK_MONOTONIC``
    nanoseconds of the node (0: never). A copy that would start later starts nothing: the
    engine, having heard no answer, may already use its pages again. Its slot shows the
    transfer begun, then FAILED; it is begun before the clock is read, so an engine that reads
    the slot after its deadline and does not find ``seq`` there knows no copy will run.
    """

    session_id: U63
    keys: Keys = []
    pages: Pages = []
    packed_keys: PackedKeys = b""  # type: ignore[assignment]  # bytes to send, a view decoded
    packed_pages: PackedPages = b""  # type: ignore[assignment]
    slot: Slot
    seq: U63
    deadline_ns: U63 = 0


class Release(_Req, tag="release", kw_only=True):
    """Cancel the transfers in ``slots`` (if still running) and drop their pins."""

    session_id: U63
    slots: Slots


class Unregister(_Req, tag="unregister", kw_only=True):
    """End the session now (also happens on disconnect or lease expiry)."""

    session_id: U63


class Stats(_Req, tag="stats", kw_only=True):
    """Ask for the daemon's counters (pool, sessions, hits, bytes); ``namespaces``: also
    list L2's namespaces (the snapshot's ``namespaces``)."""

    admin_token: Text = ""
    namespaces: bool = False


class Health(_Req, tag="health", kw_only=True):
    """Is the daemon serving? Answered by :class:`HealthReply`."""


class Flush(_Req, tag="flush", kw_only=True):
    """Drop cached pages (admin, or a session for its own namespace).

    ``tier``: ``l2``, ``l3`` or ``all``; ``namespace``: a fingerprint (hex) to limit the
    flush to, or empty for every namespace of the caller's tenant (admin: of everyone);
    ``reclaim``: give the L3 store's freed disk space back (the ``file`` backend punches its
    free slots out of the segment files); False keeps it allocated for the next writes.
    """

    admin_token: Text = ""
    session_id: U63 = 0
    tier: FlushTier = "l2"
    namespace: Fingerprint = ""
    reclaim: bool = True


class Sync(_Req, tag="sync", kw_only=True):
    """Write every L2 page not yet in L3 to L3 and answer when they are written (admin).

    Pages already queued for L3 are waited for too. The reply comes when every one of
    them is written or given up, or after ``timeout_s`` seconds (``left`` > 0 then; the
    writes go on). Refused with ``BAD_MESSAGE`` when the daemon has no L3 backend.
    """

    admin_token: Text = ""
    timeout_s: SyncTimeout = 60.0


class Prefetch(_Req, tag="prefetch", kw_only=True):
    """Start filling L2 from L3 for ``keys[skip:]`` (``skip`` leading keys are in L2)."""

    session_id: U63
    keys: Keys
    skip: Skip = 0
    request_id: Name = ""


class Claim(_Req, tag="claim", kw_only=True):
    """End a prefetch per the policy; answered with the L2 run now usable (pinned = False)."""

    session_id: U63
    keys: Keys
    request_id: Name = ""
    policy: ClaimPolicy = ""
    round: U63 = 0  # a TP rank's count of its CLAIMs, this one included (0: not counted)


Request = (
    Register
    | Heartbeat
    | Lookup
    | Store
    | Load
    | Release
    | Unregister
    | Stats
    | Health
    | Flush
    | Prefetch
    | Claim
    | Sync
)


class _Rep(msgspec.Struct, tag_field="op", kw_only=True):
    req_id: int
    epoch: int


class Registered(_Rep, tag="registered", kw_only=True):
    """Session accepted. ``ns_fingerprint`` seeds the page-key chain (tenant included).

    The completion block is the read-only descriptor the handover reply carried;
    ``completion_name`` is a label only (no file by that name exists). ``packed_lookup``:
    the daemon takes LOOKUP's ``packed_keys`` (a daemon that predates it leaves it out,
    so a client reads False and sends ``keys``); ``packed_transfers``: the same for LOAD's
    and STORE's ``packed_keys`` and ``packed_pages``; ``kv_events``: the daemon publishes
    KV events, so a STORE's ``engine`` hashes are worth sending.

    A session whose memory is ``cuda_ipc`` also gets the daemon's interprocess CUDA events
    (docs/gpu.md): ``event_handles``, one 64-byte ``cudaIpcEventHandle_t`` per layer, which
    the daemon records after that layer's copies, and ``ready_event``, the one the engine
    records before each STORE or LOAD. Both are empty for every other session; decoding
    refuses a reply that has one without the other.
    """

    session_id: U63
    lease_s: float
    ns_fingerprint: bytes
    completion_name: str
    completion_slots: int
    daemon_pid: int
    packed_lookup: bool = False
    packed_transfers: bool = False
    kv_events: bool = False
    event_handles: EventHandles = []
    ready_event: OptionalEventHandle = b""

    def __post_init__(self) -> None:
        if bool(self.event_handles) != bool(self.ready_event):
            raise ValueError(
                f"event_handles ({len(self.event_handles)}) and ready_event "
                f"({len(self.ready_event)} bytes) come together: both or neither"
            )
        if self.ready_event and len(self.ready_event) != MAX_HANDLE_BYTES:
            raise ValueError(
                f"ready_event must be a {MAX_HANDLE_BYTES}-byte CUDA IPC event handle, "
                f"got {len(self.ready_event)} bytes"
            )


class Ack(_Rep, tag="ack", kw_only=True):
    """A request that returns nothing but success (heartbeat, release, unregister)."""


class LookupResult(_Rep, tag="lookup_result", kw_only=True):
    """``l2`` leading keys are in L2; the next ``l3`` keys are in L3."""

    l2: int
    l3: int = 0


class StoreAccepted(_Rep, tag="store_accepted", kw_only=True):
    """``keys[:count]`` are in L2 or being written by this STORE (a key another transfer is
    still writing ends the run); ``writing`` pages are copied now (those past ``count``
    too: they are stored, after a key not yet in L2).

    When ``writing`` is 0 no transfer runs and the slot is not signalled.
    """

    count: int
    writing: int


class LoadAccepted(_Rep, tag="load_accepted", kw_only=True):
    """``keys[:count]`` are pinned and being copied; 0 means nothing runs (a miss)."""

    count: int


class StatsReply(_Rep, tag="stats_reply", kw_only=True):
    """Counters as a plain dict (documented in docs/protocol.md)."""

    stats: dict[str, object]


class HealthReply(_Rep, tag="health_reply", kw_only=True):
    """``status``: ``ok`` (serving), ``starting`` (the socket is up, the pool is being
    adopted: other requests are held until then), ``stopping``, or ``degraded`` with a
    reason (L3 failing, L2 serving)."""

    status: str
    sessions: int
    protocol_version: int = PROTOCOL_VERSION


class FlushReply(_Rep, tag="flush_reply", kw_only=True):
    """How many pages a FLUSH dropped per tier; ``l3_error``: why L3's pages of its scope
    were not all deleted (L3 not open or down, its listing or a delete failed), empty when
    they were (or L3 was not asked); ``tenants``: the tenants the FLUSH was limited to
    (empty: not limited by tenant)."""

    l2_pages: int
    l3_pages: int = 0
    l3_error: str = ""
    tenants: tuple[str, ...] = ()


class SyncReply(_Rep, tag="sync_reply", kw_only=True):
    """What a SYNC waited for: ``pages`` (the L2 pages not in L3 when it arrived, queued
    then or before), of which ``written`` reached L3 (or were found there), ``failed`` were
    not written (given up after their retries, or gone from L2 before their turn), and
    ``left`` were still pending at the deadline; ``l3_error``: why L3 took none of them
    (not open, or down), empty while it is healthy."""

    pages: int
    written: int
    failed: int
    left: int
    l3_error: str = ""


class PrefetchReply(_Rep, tag="prefetch_reply", kw_only=True):
    """``started`` pages are being fetched from L3 into L2 by this prefetch; ``coming``: the
    leading run of ``keys[skip:]`` in L2 now or on its way there (being read by this prefetch
    or by ones already running, or stored); 0: nothing comes (L3 holds less than
    ``prefetch_threshold`` tokens there, or is unreachable)."""

    started: int
    coming: int = 0


class ClaimReply(_Rep, tag="claim_reply", kw_only=True):
    """``l2`` leading keys are now in L2 (the prefetch for them is over)."""

    l2: int


class ErrorReply(_Rep, tag="error", kw_only=True):
    """A refused request: nothing was changed."""

    code: int
    message: str


Reply = (
    Registered
    | Ack
    | LookupResult
    | StoreAccepted
    | LoadAccepted
    | StatsReply
    | HealthReply
    | FlushReply
    | PrefetchReply
    | ClaimReply
    | SyncReply
    | ErrorReply
)

_encoder = msgspec.msgpack.Encoder()
_req_decoder = msgspec.msgpack.Decoder(Request)
_rep_decoder = msgspec.msgpack.Decoder(Reply)


def encode(msg: msgspec.Struct) -> bytes:
    """Encode a request or reply to bytes."""
    return _encoder.encode(msg)


def decode_request(data: bytes | memoryview) -> Request:
    """Decode a request, every field within its wire bounds.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: not a valid request; the message
            names the field (``- at `$.geometry.num_layers```) and is at most
            :data:`MAX_ERROR_CHARS` long, whatever the value was (the daemon answers
            :attr:`ErrorCode.BAD_MESSAGE` with it).
    """
    try:
        return _req_decoder.decode(data)
    except msgspec.ValidationError as err:
        if len(str(err)) <= MAX_ERROR_CHARS:
            raise
        raise msgspec.ValidationError(_shorten(str(err))) from None


def _shorten(text: str) -> str:
    head, at, path = text.rpartition(" - at `")
    if not at:  # no field path: keep the start
        return text[: MAX_ERROR_CHARS - 1] + "…"
    tail = at + path[: MAX_ERROR_CHARS // 2]
    return head[: MAX_ERROR_CHARS - len(tail) - 1] + "…" + tail


def decode_reply(data: bytes | memoryview) -> Reply:
    """Decode a reply; raises msgspec errors when it is not one."""
    return _rep_decoder.decode(data)


def peek_req_id(data: bytes | memoryview) -> int:
    """Best-effort request id of a message that is not decoded whole (0 if none is found).

    Looks for the ``req_id`` entry near the start of the MessagePack map, so an oversized
    or truncated message can still be answered with its request id.
    """
    head = bytes(data[:128])
    at = head.find(b"\xa6req_id")
    if at < 0:
        return 0
    i = at + 7
    if i >= len(head):
        return 0
    b = head[i]
    if b < 0x80:
        return b
    sizes = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
    n = sizes.get(b)
    if n is None or i + 1 + n > len(head):
        return 0
    return int.from_bytes(head[i + 1 : i + 1 + n], "big")
