"""Wire bounds: the range of every field a client may send, as msgspec constraints.

:mod:`kvtier.ipc.protocol` types its request fields with these, so a value outside its
range is refused at decode, as ``BAD_MESSAGE`` with an error naming the field, before the
daemon takes anything (no pin, no slot, no session). Bounds that depend on the daemon's
state (a page index below the engine's ``num_pages``, a transfer slot below the completion
block's slots, ``tp_rank < tp_size``, at most ``max_keys_per_request`` keys) stay in the
daemon. Strings never hold a NUL (they become paths and log lines).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

KEY_BYTES = 32
"""A page key (SHA-256)."""
MAX_U63 = (1 << 63) - 1
"""Largest id or ``seq``: the completion block stores ``seq`` as an int64."""
MAX_PID = 1 << 22
"""Linux's PID_MAX_LIMIT; ``pid`` 0 means "not told" (no liveness checks)."""
MAX_KEYS = 65536
"""Most keys (and pages) in one request."""
MAX_PAGES = 1 << 26
"""Most pages in one engine export."""
MAX_LAYERS = 1 << 12
"""Most transformer layers in a geometry."""
MAX_BUFFERS = 2 * MAX_LAYERS
"""Most (layer, component) buffers, and segments, in one export."""
MAX_DIM = 1 << 20
"""Largest ``page_size``, ``kv_heads`` and ``head_dim``."""
MAX_SEGMENT_BYTES = 1 << 48
"""Largest exported allocation, and buffer offset in one."""
MAX_SLOTS = 1 << 16
"""Transfer slot numbers are below this (the daemon's completion block has fewer)."""
MAX_SYNC_TIMEOUT_S = 3600.0
"""Longest a SYNC may ask the daemon to wait."""
MAX_NAME = 256
"""Longest tenant, revision, TP group, request id, device UUID."""
MAX_TEXT = 4096
"""Longest model id (may be a local path), cache salt, token."""
MAX_SEGMENT_NAME = 512
"""Longest segment name: a path in the shared-memory directory (a file name is at most 255
bytes on Linux) or a CUDA IPC label."""
MAX_HANDLE_BYTES = 64
"""A CUDA IPC memory handle."""
HANDOVER_TOKEN_BYTES = 16
"""A memory handover token (random, chosen by the engine; see :mod:`kvtier.ipc.fdpass`)."""
MAX_HANDOVER_FDS = 64
"""Most descriptors one handover may pass, so most segments in a ``kind = "fd"`` export."""
MAX_TOKEN_IDS = 1 << 22
"""Most token ids a STORE's engine block description carries."""
MAX_BLOCK_HASH_BYTES = 64
"""Longest engine block hash given as bytes (vLLM's are 32; ints are 64-bit)."""
MAX_MESSAGE_BYTES = 32 << 20
"""Transport ceiling on one frame (ZeroMQ ``MAXMSGSIZE`` on the daemon's socket).

The largest request these bounds allow, a REGISTER of :data:`MAX_BUFFERS` segments with
every string at its longest in ASCII, encodes to under 8 MiB (a STORE of :data:`MAX_KEYS`
keys and pages to under 3 MiB), within the daemon's ``max_message_bytes`` (16 MiB by
default), which answers bigger ones with an error naming the limit. String bounds count
characters: with 4-byte UTF-8 characters that REGISTER is about 26 MiB, past the default. A frame past
this ceiling is dropped by ZeroMQ, with its connection, before it is buffered."""

MAX_TP = 1024
"""Largest tensor-parallel group (``tp_size``)."""
MAX_ERROR_CHARS = 400
"""Longest decode error message (msgspec quotes a bad enum value whole)."""

_NO_NUL = "^[^\\x00]*$"

# integers
U63 = Annotated[int, Meta(ge=0, le=MAX_U63)]
"""Request ids, session ids, ``seq``."""
ProtocolVersion = Annotated[int, Meta(ge=0, le=0xFFFF)]
Pid = Annotated[int, Meta(ge=0, le=MAX_PID)]
TpRank = Annotated[int, Meta(ge=0, lt=MAX_TP)]
TpSize = Annotated[int, Meta(ge=1, le=MAX_TP)]
Layers = Annotated[int, Meta(ge=1, le=MAX_LAYERS)]
Dim = Annotated[int, Meta(ge=1, le=MAX_DIM)]
PageCount = Annotated[int, Meta(ge=1, le=MAX_PAGES)]
SegmentBytes = Annotated[int, Meta(ge=1, le=MAX_SEGMENT_BYTES)]
SegmentOffset = Annotated[int, Meta(ge=0, le=MAX_SEGMENT_BYTES)]
RegionLayer = Annotated[int, Meta(ge=-1, lt=MAX_LAYERS)]
"""The layer a memory region holds, or -1 for a region holding several layers."""
Slot = Annotated[int, Meta(ge=0, lt=MAX_SLOTS)]
Skip = Annotated[int, Meta(ge=0, le=MAX_KEYS)]
SyncTimeout = Annotated[float, Meta(gt=0, le=MAX_SYNC_TIMEOUT_S)]
"""Seconds, in (0, :data:`MAX_SYNC_TIMEOUT_S`] (NaN and infinity are refused)."""

# lists
Key = Annotated[bytes, Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
Keys = Annotated[list[Key], Meta(max_length=MAX_KEYS)]
BlockHash = int | Annotated[bytes, Meta(min_length=1, max_length=MAX_BLOCK_HASH_BYTES)]
"""An engine's block hash: an int (MessagePack bounds it to a signed or unsigned 64-bit
one), or 1-64 bytes."""
BlockHashes = Annotated[list[BlockHash], Meta(max_length=MAX_KEYS)]
PackedTokens = Annotated[bytes, Meta(max_length=MAX_TOKEN_IDS * 4)]
"""Token ids as little-endian uint32 back to back (:func:`~kvtier.ipc.packed.pack_tokens`):
one bytes object to decode instead of a checked int per token."""
BlockSize = Annotated[int, Meta(ge=1, le=MAX_DIM)]
PackedKeys = Annotated[memoryview, Meta(max_length=MAX_KEYS * KEY_BYTES)]
"""Keys back to back, :data:`KEY_BYTES` each (a whole number of them is checked by the
daemon): one byte string instead of a list of them. Sent as bytes; decoded as a view of
the received message, not a copy of it."""
Pages = Annotated[list[Annotated[int, Meta(ge=0, lt=MAX_PAGES)]], Meta(max_length=MAX_KEYS)]
"""Engine page indices, as many as the keys beside them."""
PAGE_INDEX_BYTES = 4
"""Bytes of one engine page index in ``packed_pages`` (little-endian unsigned)."""
PackedPages = Annotated[memoryview, Meta(max_length=MAX_KEYS * PAGE_INDEX_BYTES)]
"""Engine page indices back to back, :data:`PAGE_INDEX_BYTES` each, little-endian (one per
key of ``packed_keys``; the daemon checks the count and each index against the engine's
pages). Sent as bytes; decoded as a view of the received message."""
Slots = Annotated[list[Slot], Meta(max_length=MAX_SLOTS)]
SegmentIndices = Annotated[
    list[Annotated[int, Meta(ge=0, lt=MAX_BUFFERS)]], Meta(max_length=MAX_BUFFERS)
]
Offsets = Annotated[
    list[Annotated[int, Meta(ge=0, le=MAX_SEGMENT_BYTES)]], Meta(max_length=MAX_BUFFERS)
]
SegmentIndex = Annotated[int, Meta(ge=0, lt=MAX_BUFFERS)]

# strings and bytes
Name = Annotated[str, Meta(max_length=MAX_NAME, pattern=_NO_NUL)]
Text = Annotated[str, Meta(max_length=MAX_TEXT, pattern=_NO_NUL)]
SegmentName = Annotated[str, Meta(max_length=MAX_SEGMENT_NAME, pattern=_NO_NUL)]
Handle = Annotated[bytes, Meta(max_length=MAX_HANDLE_BYTES)]
EventHandle = Annotated[bytes, Meta(min_length=MAX_HANDLE_BYTES, max_length=MAX_HANDLE_BYTES)]
"""A CUDA IPC event handle (``cudaIpcEventHandle_t``): exactly 64 bytes, any byte values."""
EventHandles = Annotated[list[EventHandle], Meta(max_length=MAX_LAYERS)]
"""One event handle per layer of a CUDA session (at most ``MAX_LAYERS``)."""
OptionalEventHandle = Annotated[bytes, Meta(max_length=MAX_HANDLE_BYTES)]
"""An event handle, or empty when the session has none (length checked after decoding)."""
HandoverToken = Annotated[bytes, Meta(max_length=HANDOVER_TOKEN_BYTES)]
"""The token of a memory handover (empty: none; the daemon then refuses the REGISTER)."""
Fingerprint = Annotated[str, Meta(pattern="^(?:[0-9a-fA-F]{64})?\\Z")]
"""A namespace fingerprint as 64 hex digits, or empty."""

# choices
DType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "uint8", "int8"]
Attention = Literal["mha", "mla"]
Layout = Annotated[str, Meta(min_length=1, max_length=32, pattern="^[a-z0-9_]+$")]
"""A label naming how the engine lays out its KV memory (``layer_first``, ``vllm_cpu``,
``sglang_page_first``, ...); it enters the namespace, so layouts never share pages."""
MemoryKind = Literal["fd", "shm", "cuda_ipc", "none"]
"""``fd``: descriptors handed over beforehand; ``none``: no memory (a control-only session,
LOOKUP only); ``shm`` (by file name) is refused by the daemon but still decodes, so the
refusal can say what to do instead."""
FlushTier = Literal["l2", "l3", "all"]
ClaimPolicy = Literal["", "best_effort", "wait_complete", "timeout"]
"""``""``: the daemon's ``hicache_storage_prefetch_policy``."""
