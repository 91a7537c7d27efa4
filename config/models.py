"""Frozen configuration models for the daemon and the client.

One model per program; the TOML file, ``KVTIER_*`` environment variables and CLI flags all
feed the same model (see :mod:`kvtier.config.loader`). Where a knob means what a SGLang
``--hicache-*`` flag means, it keeps that name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from kvtier.config.redact import SECRET_WORDS, redact_value
from kvtier.config.sizes import ByteSize
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from typing import Self

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
StorageBackendName = Literal["none", "file", "mooncake", "redis", "dynamic"]
LogLevel = Literal["debug", "info", "warning", "error"]
NativeKernel = Literal["copy_threads", "file_io", "guarded_copy", "region_copy"]
"""kvtier's switchable C kernels (:mod:`kvtier.kernels.native`)."""


class _Frozen(BaseModel):
    # no setting is infinite or NaN: a timeout of inf seconds overflows ZeroMQ's poll
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False
    )

    # A validation error shows the input it refused; a token's is hidden (the field's, and
    # any ``*token*`` key of a table shown whole), however the model is built.
    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise _without_secrets(err) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """:meth:`pydantic.BaseModel.model_validate`, its errors showing no token."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as err:
            raise _without_secrets(err) from None


_TENANT_SHOWN = ("quota_pages", "max_sessions", "max_mapped_bytes")
"""The fields of a tenant's table an error may quote (not its token, nor a misspelt one)."""


def hides(loc: Sequence[str | int], kind: str = "") -> bool:
    """Whether an error about the value at ``loc`` (pydantic's error type ``kind``) must
    not quote it: a key naming a secret, a key no model has (a misspelt secret one, maybe),
    or in the tenants' tables anything but a tenant's quotas (a tenant written as its bare
    token, a misspelt ``token``)."""
    parts = [str(p) for p in loc]
    if kind == "extra_forbidden":
        return True
    if any(word in p.lower() for p in parts for word in SECRET_WORDS):
        return True
    return parts[:1] == ["tenants"] and (len(parts) < 3 or parts[2] not in _TENANT_SHOWN)


def shown(loc: Sequence[str | int], value: Any, kind: str = "") -> Any:
    """``value`` (found at ``loc``) as an error may quote it: ``<redacted>`` where
    :func:`hides` says so, tables item by item, URLs without their password."""
    if hides(loc, kind):
        return "<redacted>"
    if isinstance(value, Mapping):
        return {k: shown([*loc, str(k)], v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [shown(loc, v) for v in value]
    return redact_value(value)


def _without_secrets(err: ValidationError) -> ValidationError:
    """``err`` with every input an error must not quote hidden (:func:`shown`)."""
    details: list[Any] = []
    for e in err.errors():
        d = {"type": e["type"], "loc": e["loc"], "input": shown(e["loc"], e["input"], e["type"])}
        if "ctx" in e:
            d["ctx"] = e["ctx"]
        details.append(d)
    return ValidationError.from_exception_data(err.title, details)


class TenantConfig(_Frozen):
    """One tenant: engines that present its token share its pages and nobody else's."""

    token: SecretStr = Field(description="Secret the tenant's engines send at registration.")
    quota_pages: int | None = Field(
        default=None, ge=1, description="Most L2 pages the tenant may hold (None: no quota)."
    )
    max_sessions: int | None = Field(
        default=None,
        ge=1,
        le=1 << 16,
        description="Most sessions the tenant's engines may hold at once, whichever users "
        "run them (None: the daemon's max_sessions_per_user).",
    )
    max_mapped_bytes: ByteSize | None = Field(
        default=None,
        ge=1 << 20,
        le=1 << 46,
        description="Most bytes of engine memory the daemon maps for the tenant's sessions "
        "at once (None: the daemon's max_mapped_bytes_per_user).",
    )


class DaemonConfig(_Frozen):
    """Everything ``kvtierd`` reads at start.

    Sizes accept ``"4GiB"``-style strings. Paths left unset (or set to an empty string) are
    derived at start (see :func:`kvtier.config.loader.runtime_dir` and
    :func:`~kvtier.config.loader.state_dir`).
    """

    runtime_dir: Path | None = Field(
        default=None,
        description="The control and memory-handover sockets and the lock (kvtierd.lock). "
        "Default: $KVTIER_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kvtier, else /tmp/kvtier-<uid>.",
    )
    state_dir: Path | None = Field(
        default=None,
        description="Persistent state: the file L3 store lives in <state_dir>/l3 unless its "
        "extra config names a path. Default: $KVTIER_STATE_DIR, else $STATE_DIRECTORY "
        "(systemd's StateDirectory=, its first path), else $XDG_STATE_HOME/kvtier, else "
        "~/.local/state/kvtier.",
    )
    hicache_size: ByteSize = Field(default=1 << 30, gt=0, description="Bytes of the L2 host pool.")
    extent_size: ByteSize = Field(
        default=32 << 20, gt=0, description="Pool extent: the unit handed to one page size class."
    )
    pool_dir: Path = Field(
        default=Path("/dev/shm"), description="Directory of the host pool's shared-memory file."
    )
    prefault: bool = Field(default=True, description="Touch every pool page at start.")
    cold_start: bool = Field(
        default=False,
        description="Discard the pool a previous kvtierd left instead of adopting it.",
    )
    verify_on_adopt: bool = Field(
        default=False,
        description="Checksum every stored page (xxh3 in the copy thread, which lowers the store "
        "bandwidth) and verify each one when a restarted daemon adopts the pool. Off: "
        "adoption relies on the write order and the sealed index rows.",
    )
    cuda_copy: Literal["dma", "kernel"] = Field(
        default="dma",
        description="How kvtierd copies a CUDA engine's pages (copy_mode daemon): dma, "
        "cudaMemcpyAsync on the GPU's copy engines, scheduled apart from the engine's compute "
        "kernels; kernel, copy kernels of its own (time-sliced against the engine's kernels).",
    )
    keep_pool_on_stop: bool = Field(
        default=True,
        description="Leave the pool file in place at a planned stop, for the next start.",
    )
    copy_threads: int = Field(default=2, ge=1, le=64, description="Worker threads that copy pages.")
    copy_nice: int = Field(
        default=5,
        ge=0,
        le=19,
        description="Nice value of the copy threads (theirs only; 0 keeps the daemon's): a "
        "thread that wakes up to answer a request (the event loop, an engine) gets a core "
        "before them, so a long STORE's copies make other engines' LOOKUPs wait less. A "
        "higher value makes the copies yield more, also to every other busy process of the "
        "node, so on a node whose cores are busy a high value starves the copies themselves.",
    )
    copy_yield_kib: int = Field(
        default=256,
        ge=0,
        le=1 << 20,
        description="The copy of a STORE of more than slice_pages pages gives its CPU up after "
        "every this many KiB (0: never): a thread that wakes up to answer a request (the event "
        "loop, another engine's) runs at once instead of at the scheduler's next tick. Only "
        "long STOREs yield: nobody's time to first token waits on them, whereas a LOAD's "
        "engine waits on its copy.",
    )
    loop_slice_us: int = Field(
        default=100,
        ge=0,
        le=100_000,
        description="Time slice (µs) the event loop and the ZeroMQ I/O threads ask the kernel "
        "for (Linux 6.12 or later; 0 keeps the default): a shorter slice lets them preempt a "
        "copy when they wake up, their share of the CPU unchanged.",
    )
    slice_pages: int = Field(
        default=256,
        ge=1,
        le=1 << 20,
        description="A STORE or LOAD of more pages allocates, commits, pins and unpins them in "
        "slices of this many, the event loop answering other engines between two slices "
        "(a big request never holds up a small one for long).",
    )
    lease_s: float = Field(default=30.0, gt=0, description="Session lease; heartbeats renew it.")
    max_sessions: int = Field(default=256, ge=1, description="Most engine sessions at once.")
    max_sessions_per_user: int = Field(
        default=128,
        ge=1,
        le=1 << 16,
        description="Most sessions one user id (the engine process's uid) may hold at once; "
        "a REGISTER past it is refused with BUSY naming this setting.",
    )
    max_handover_connections_per_user: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Handover-socket connections one user id may hold open at once (each has "
        "2 s to send its request); a connection past it is answered 'busy' and closed, "
        "and the client tries again until its deadline.",
    )
    max_handover_connections: int = Field(
        default=1024,
        ge=1,
        le=65536,
        description="Handover-socket connections open at once, all users together; past it "
        "the user holding the most gives up its oldest connection.",
    )
    max_handovers_waiting_per_user: int = Field(
        default=128,
        ge=1,
        le=4096,
        description="Handovers of one user id waiting for their REGISTER (each holds its "
        "descriptors for up to 10 s); past it the handover is answered 'busy'.",
    )
    max_handovers_waiting: int = Field(
        default=1024,
        ge=1,
        le=65536,
        description="Handovers waiting for their REGISTER, all users together.",
    )
    max_handover_descriptors_per_user: int = Field(
        default=4096,
        ge=64,
        le=1 << 20,
        description="Descriptors one user id's waiting handovers may hold in the daemon (a "
        "handover brings up to 64); past it the handover is answered 'busy'. All users "
        "together may hold half the daemon's descriptor limit (RLIMIT_NOFILE, raised to its "
        "hard limit at start).",
    )
    max_mapped_bytes_per_user: ByteSize | None = Field(
        default=None,
        ge=1 << 20,
        le=1 << 46,
        description="Most bytes of engine memory the daemon maps for one user id's sessions "
        "at once (only the spans the declared regions use count). Default: twice the node's "
        "physical memory. A REGISTER past it is refused naming this setting.",
    )
    max_mapped_bytes: ByteSize | None = Field(
        default=None,
        ge=1 << 20,
        le=1 << 46,
        description="Most bytes of engine memory mapped at once, all users together (the "
        "daemon's address space). Default: eight times the node's physical memory, at most "
        "32 TiB.",
    )
    max_mapped_segments_per_user: int = Field(
        default=4096,
        ge=1,
        le=65536,
        description="Most memory mappings the daemon holds for one user id's sessions at "
        "once (one per run of a segment the regions use; the kernel allows about 65,000 "
        "per process).",
    )
    prefault_threads: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Threads that build page tables over engines' memory after REGISTER; "
        "users take turns, 16 MiB at a time, so no user's memory delays another's for long.",
    )
    max_message_bytes: ByteSize = Field(
        default=16 << 20,
        ge=4096,
        le=32 << 20,
        description="Largest control message accepted (at most 32 MiB: the socket's own frame "
        "limit, ZeroMQ MAXMSGSIZE, drops larger frames before they are read).",
    )
    max_keys_per_request: int = Field(default=65536, ge=1, description="Keys in one request.")
    shutdown_timeout_s: float = Field(
        default=10.0, ge=0, description="How long a stop waits for in-flight transfers."
    )
    log_level: LogLevel = Field(default="info", description="Log verbosity.")
    hicache_storage_backend: StorageBackendName = Field(
        default="file",
        description="L3 backend: file (the default: a disk store in <state_dir>/l3 that survives "
        "restarts and reboots), none (L2 only), mooncake, redis or dynamic.",
    )
    hicache_storage_backend_extra_config: str | None = Field(
        default=None, description="Backend settings as JSON, or @path to a JSON/TOML file."
    )
    hicache_storage_prefetch_policy: PrefetchPolicy = Field(
        default="timeout", description="How CLAIM ends a prefetch."
    )
    hicache_write_policy: Literal["write_through", "write_back"] = Field(
        default="write_through", description="When L2 pages are written to L3."
    )
    eviction_policy: Literal["lru", "arc", "reuse"] = Field(
        default="reuse",
        description="Which L2 page a full pool evicts (never one with a resident child, so "
        "chains go tail first): lru, the least recently used; arc, ARC's adaptive split "
        "between pages stored once and pages used again; reuse, the same split with a long "
        "memory of evicted keys (4 a page of the pool, at most about 500 bytes of daemon "
        "memory a page), so a page stored again minutes after its eviction counts as reused, "
        "and pages used again kept for as long as 19 in 20 reuses take (a lifetime measured "
        "as it runs). reuse keeps more prefix hits than lru from the same memory on traffic "
        "that comes back after a while, and runs in C with the allocator; arc's steps run in "
        "Python. A restart keeps the pages, their recency, the split and reuse's lifetime, "
        "not arc's target nor the memory of recent evictions.",
    )
    prefetch_threshold: int = Field(
        default=256, ge=0, description="Tokens an L3 run must reach before it is prefetched."
    )
    prefetch_timeout_base: float = Field(default=2.0, ge=0, description="Seconds, timeout policy.")
    prefetch_timeout_per_ki_token: float = Field(
        default=0.1, ge=0, description="Extra seconds per 1024 tokens, timeout policy."
    )
    prefetch_timeout_max: float = Field(default=30.0, gt=0, description="Upper bound, seconds.")
    prefetch_concurrency: int = Field(default=4, ge=1, description="L3 reads in flight at once.")
    write_back_queue: int = Field(default=4096, ge=1, description="Pages queued for L3 at most.")
    storage_timeout_s: float = Field(
        default=0.5,
        gt=0,
        description="Longest L3 existence check inside LOOKUP or PREFETCH; "
        "past it the check is a miss and L3 is skipped until a health check passes.",
    )
    tp_group_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="How long LOOKUP/CLAIM of a tensor-parallel rank waits "
        "for the other ranks of its engine; a rank that never asks makes the answer 0.",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Prometheus port on metrics_host (off when unset).",
    )
    metrics_host: str = Field(default="127.0.0.1", description="Metrics bind address.")
    admin_token: SecretStr | None = Field(
        default=None,
        description="Credential the admin requests must carry (kvtier stats, sessions, "
        "namespaces, flush and sync; health needs none); unset: anyone who can reach the socket.",
    )
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict,
        description="Tenant name → token and quota. Empty: one default tenant.",
    )
    kv_events_endpoint: str | None = Field(
        default=None,
        description="Where kvtierd publishes KV events in vLLM's format (ZeroMQ "
        "PUB, bound: tcp://127.0.0.1:5557 or ipc://path); unset: no events.",
    )
    kv_events_replay_endpoint: str | None = Field(
        default=None,
        description="ROUTER endpoint (bound) answering replay requests for "
        "missed batches, as vLLM's publisher does; unset: no replay.",
    )
    kv_events_buffer_steps: int = Field(
        default=10_000, ge=1, le=1_000_000, description="Batches kept for replay."
    )
    kv_events_hwm: int = Field(
        default=10_000,
        ge=1,
        description="ZeroMQ high-water mark of the PUB socket: batches "
        "queued for a subscriber before it misses further ones (it sees the gap and "
        "replays them; the other subscribers get them).",
    )
    kv_events_interval_s: float = Field(
        default=0.005,
        ge=0,
        le=1.0,
        description="How long events gather before they go out as batches (0: at the "
        "end of each event-loop turn); fewer, larger batches cost the daemon and its "
        "subscribers less, at this much delay.",
    )
    kv_events_max_batch: int = Field(
        default=1024, ge=1, le=65536, description="Most events in one published batch."
    )
    kv_events_replay_max: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="Most batches one replay request is answered with.",
    )
    kv_events_max_hashes: int = Field(
        default=1 << 20,
        ge=0,
        description="Engine block hashes remembered (page key → hash) "
        "so evictions and L3 events name a page by the engine's hash; the oldest go beyond it.",
    )
    native_off: list[NativeKernel] = Field(
        default_factory=list,
        description="C kernels not to use; each then takes its Python or "
        "numpy path: file_io (file L3 page I/O and L3 object headers), guarded_copy (copies of "
        "engine memory that may shrink: such memory is then copied with pread/pwrite), "
        "region_copy (one-call copies of mapped regions: numpy copy plans then), copy_threads "
        "(copy threads that run region copies without the GIL: Python copy threads then). "
        "Default: none "
        "(every kernel that is built runs). E.g. '[\"file_io\"]'.",
    )

    @field_validator("runtime_dir", "state_dir", mode="before")
    @classmethod
    def _empty_path_is_unset(cls, value: object) -> object:
        # KVTIER_STATE_DIR= (or a unit's Environment=KVTIER_STATE_DIR=) means "not set", not
        # Path("") == the daemon's working directory.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint", mode="before")
    @classmethod
    def _check_event_endpoint(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None  # KVTIER_KV_EVENTS_ENDPOINT= means "not set"
        if isinstance(value, str) and not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{value!r} is not a tcp:// or ipc:// endpoint")
        return value

    @model_validator(mode="after")
    def _check(self) -> DaemonConfig:
        if self.extent_size % 4096:
            raise ValueError(
                f"extent_size ({self.extent_size}) must be a multiple of 4096 bytes (4KiB)"
            )
        if self.extent_size > self.hicache_size:
            raise ValueError(
                f"extent_size ({self.extent_size}) must not exceed hicache_size ({self.hicache_size})"
            )
        if self.kv_events_replay_endpoint is not None and (
            self.kv_events_endpoint is None
            or self.kv_events_replay_endpoint == self.kv_events_endpoint
        ):
            raise ValueError(
                f"kv_events_replay_endpoint = {self.kv_events_replay_endpoint!r} needs a "
                f"distinct kv_events_endpoint (it is {self.kv_events_endpoint!r})"
            )
        self._check_tokens()
        return self

    def _check_tokens(self) -> None:
        """Each tenant's token is its own: not empty, not another tenant's (a token names
        one tenant: scoped STATS and FLUSH would cover both), not the admin token. Errors
        name the tenants, never a token."""
        admin = self.admin_token.get_secret_value() if self.admin_token is not None else None
        seen: dict[str, str] = {}
        for name, t in self.tenants.items():
            token = t.token.get_secret_value()
            if not token:
                raise ValueError(f"tenants.{name}.token is empty")
            if token in seen:
                raise ValueError(
                    f"tenants.{name}.token and tenants.{seen[token]}.token are the same: "
                    "each tenant needs a token of its own"
                )
            if token == admin:
                raise ValueError(f"tenants.{name}.token is the admin_token: choose another")
            seen[token] = name


class ClientConfig(_Frozen):
    """What an engine's kvtier client reads: where the daemon is, timeouts, policies."""

    runtime_dir: Path | None = Field(
        default=None, description="Where the daemon's socket is (same default as the daemon)."
    )
    endpoint: str | None = Field(
        default=None, description="ZeroMQ endpoint; overrides runtime_dir (ipc://... or tcp://...)."
    )
    request_timeout_s: float = Field(
        default=2.0, gt=0, description="A control request not answered by then counts as a miss."
    )
    load_timeout_s: float = Field(
        default=10.0, gt=0, description="Longest wait for one layer of a load before it fails."
    )
    heartbeat_interval_s: float = Field(
        default=5.0, gt=0, le=86_400, description="Heartbeat period (at most a day)."
    )
    hicache_write_policy: WritePolicy = Field(
        default="write_through", description="When L1 pages are backed up to L2."
    )
    write_through_threshold: int = Field(
        default=2, ge=1, description="Hits before write_through_selective backs a page up."
    )
    hicache_storage_prefetch_policy: PrefetchPolicy | None = Field(
        default=None,
        description="How a claim that names no policy ends a prefetch "
        "(None: the daemon's hicache_storage_prefetch_policy).",
    )
    prefetch_threshold: int = Field(
        default=256, ge=0, description="Tokens before L3 is prefetched."
    )
    hicache_mem_layout: Literal["layer_first"] = Field(
        default="layer_first", description="Engine KV layout (per layer K and V)."
    )
    claim_timeout_s: float = Field(
        default=35.0,
        gt=0,
        description="Longest wait for a CLAIM reply (it may wait for its "
        "prefetch up to the daemon's prefetch_timeout_max, then for the other TP ranks).",
    )
    # the length bounds are REGISTER's (kvtier.ipc.limits MAX_NAME, MAX_TEXT): a value
    # past them is a configuration error naming the setting, not a refused registration
    tp_group: str = Field(
        default="",
        max_length=256,
        description="Names this engine's tensor-parallel rank group; engines of the "
        "same model and tp_size on one node must use distinct names.",
    )
    tenant: str = Field(
        default="default", max_length=256, description="Tenant name sent at registration."
    )
    token: SecretStr | None = Field(default=None, max_length=4096, description="Tenant token.")
    cache_salt: str = Field(
        default="", max_length=4096, description="Extra salt entering the namespace."
    )

    @field_validator("endpoint", mode="before")
    @classmethod
    def _check_endpoint(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None  # KVTIER_ENDPOINT= means "not set"
        if isinstance(value, str) and not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{value!r} is not a tcp:// or ipc:// endpoint")
        return value
