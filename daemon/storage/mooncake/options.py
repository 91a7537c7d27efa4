"""Extra-config keys of the ``mooncake`` backend."""

from __future__ import annotations

from typing import Literal

from kvtier.config.sizes import ByteSize
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["MooncakeOptions"]

MAX_BYTES = 1 << 50
"""The largest size a byte-size key takes (1 PiB): Mooncake takes sizes as 64-bit integers."""


class MooncakeOptions(BaseModel):
    """Extra-config keys of the ``mooncake`` backend (the first six as SGLang's Mooncake config)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    master_server_address: str = Field(default="127.0.0.1:50051", min_length=1)
    """``host:port`` of mooncake_master's RPC server."""
    metadata_server: str = Field(default="http://127.0.0.1:8080/metadata", min_length=1)
    """Metadata service: the master's HTTP metadata server URL (or etcd / ``P2PHANDSHAKE``)."""
    local_hostname: str = Field(default="127.0.0.1", min_length=1)
    """Address this daemon's segment is advertised at; also its TCP bind address when it is
    an IP literal and ``MC_TCP_BIND_ADDRESS`` is not set."""
    global_segment_size: ByteSize = Field(default=1 << 30, ge=0, le=MAX_BYTES)
    """Memory this daemon contributes to the cluster store (``"4GiB"`` style or bytes); 0 = none."""
    local_buffer_size: ByteSize = Field(default=16 << 20, ge=0, le=MAX_BYTES)
    """Mooncake's client-side staging buffer (zero-copy transfers do not use it)."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transfer protocol."""
    device_name: str = ""
    """RDMA device list for ``protocol = "rdma"``; empty for TCP."""
    prefix: str = Field(default="kvtier", min_length=1, max_length=128, pattern=r"^\S+$")
    """First component of every object key."""
    max_inflight: int = Field(default=4, ge=1, le=64)
    """Mooncake calls in flight at once, over all batches (worker threads of this backend)."""
    sub_batch_keys: int = Field(default=256, ge=1, le=4096)
    """Most keys in one Mooncake call; a larger batch is split into calls that run concurrently.
    Concurrent transfers to one peer over TCP slow each other down (a 64-key batch moves
    markedly less as 4 concurrent calls than as one), so a typical batch stays one call."""
    timeout_s: float = Field(default=5.0, gt=0, le=3600)
    """Bound on reaching the master and the HTTP metadata server at open (checked before
    Mooncake's own setup, which retries for about 90 s against an address that refuses)."""
    retry_interval_s: float = Field(default=1.0, gt=0, le=3600)
    """After a fault, operations fail fast (as misses) for this long, then one is let through
    to try the store again; calls to an unreachable master can otherwise block for seconds."""
    worker_nice: int = Field(default=10, ge=0, le=19)
    """How much lower than the daemon's the priority (nice value) of this backend's worker
    threads is. A Mooncake batch call busy-polls in its calling thread until the transfer
    completes; at a lower priority that poll gives way to the transfer's own threads (and to
    the rest of the daemon) when the CPUs are all busy, instead of taking a core from them.
    Mooncake's own threads keep the daemon's priority. 0 leaves the workers as they are."""

    @field_validator("master_server_address")
    @classmethod
    def _host_and_port(cls, value: str) -> str:
        """``host:port`` (port 1-65535), or a URL-like form Mooncake resolves itself
        (``etcd://...``): an address without a port would leave Mooncake retrying for
        about 90 s."""
        if "://" in value:
            return value
        host, _, port = value.rpartition(":")
        if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:50051)")
        return value
