"""Where the reference engine's KV cache lives, and how kvtierd reaches it (the copy modes).

``copy_mode`` says who copies pages between the engine's KV cache and kvtierd's pool:

``daemon``: kvtierd copies, straight into the engine's memory.
    On the CPU the cache is a :class:`~kvtier.client.kv_pool.shared.SharedKVPool` (a sealed
    memfd the daemon maps); on CUDA a :class:`~kvtier.client.kv_pool.cuda.CudaKVPool`
    exported by CUDA IPC (the daemon copies by DMA on its own stream, and
    ``wait_layer(i)`` makes the compute stream wait on the daemon's event of layer ``i``).
``engine``: the engine copies.
    The cache is plain tensors on the engine's device; pages go device ↔ a bounded
    :class:`~kvtier.client.staging.area.StagingArea` (pinned on CUDA) that is what the engine
    registers, and kvtierd copies staging ↔ pool on the CPU, with no CUDA context
    (:class:`~kvtier.client.cache.staged.StagedConnection`).

Both modes register the same ``layer_first`` page bytes under the same geometry, so engines of
either mode share cached pages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from kvtier.client.cache.link import CacheLink
from kvtier.client.cache.staged import StagedConnection
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.cuda import CudaKVPool
from kvtier.client.kv_pool.shared import SharedKVPool
from kvtier.config import ClientConfig
from kvtier.engine.model import EngineInputError, ModelConfig, new_kv_cache
from kvtier.ipc.cuda_backend import EngineCudaBackend
from kvtier.ipc.cuda_runtime import cuda_unavailable_reason
from kvtier.ipc.protocol import Geometry

__all__ = ["COPY_MODES", "CopyMode", "EngineKV", "default_copy_mode", "engine_device", "open_kv"]

CopyMode = Literal["daemon", "engine"]
COPY_MODES: tuple[CopyMode, ...] = ("daemon", "engine")


def engine_device(device: torch.device | str) -> torch.device:
    """The engine's device, checked: the CPU or an available CUDA device, with its index.

    Raises:
        EngineInputError: an unknown device, another kind of device, or CUDA that torch
            does not see.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise EngineInputError(f"device {device!r} is not a torch device: {err}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise EngineInputError(f"device must be 'cpu' or a CUDA device, got {str(dev)!r}")
    if not torch.cuda.is_available():
        raise EngineInputError(f"device {str(dev)!r}: torch reports no CUDA device here")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise EngineInputError(
            f"device {str(dev)!r}: torch sees {torch.cuda.device_count()} CUDA devices"
        )
    return torch.device("cuda", index)


def default_copy_mode(device: torch.device) -> CopyMode:
    """``daemon`` on the CPU, and on CUDA where this process has CuPy: kvtierd then copies by
    DMA straight into the KV cache, one copy fewer than ``engine``, and its layer-wise loads
    overlap the forward pass also beside other work on the GPU (docs/gpu.md); ``engine`` on
    CUDA without CuPy. :class:`~kvtier.engine.engine.ReferenceEngine` also falls back to
    ``engine`` when kvtierd refuses the GPU memory."""
    if device.type != "cuda":
        return "daemon"
    return "daemon" if cuda_unavailable_reason() is None else "engine"


class EngineKV:
    """The engine's KV cache and, with kvtier on, its link to kvtierd.

    Attributes:
        k_cache / v_cache: per layer ``[num_pages, page_size, kv_heads, head_dim]`` tensors on
            the engine's device.
        link: what the cache manager talks to (None with kvtier off).
    """

    def __init__(
        self,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        link: CacheLink | None = None,
        closers: list[Callable[[], object]] | None = None,
    ) -> None:
        self.k_cache, self.v_cache, self.link = k_cache, v_cache, link
        self._closers = closers or []

    def close(self) -> None:
        """Unregister, then free the memory the daemon used (in that order). Idempotent."""
        closers, self._closers = self._closers, []
        try:
            while closers:
                closers.pop(0)()
        finally:
            for c in closers:  # a failed close still frees what comes after it
                c()
        self.k_cache, self.v_cache, self.link = [], [], None


def open_kv(
    cfg: ModelConfig,
    geometry: Geometry,
    num_pages: int,
    device: torch.device,
    *,
    kvtier: bool,
    copy_mode: CopyMode,
    client_config: ClientConfig,
    model_id: str,
    staging_pages: int,
    staging_wait_s: float,
    cuda_backend: EngineCudaBackend | None = None,
) -> EngineKV:
    """Allocate the KV cache and, with ``kvtier``, register it per ``copy_mode``.

    Args:
        cfg / geometry / num_pages: the model, its page geometry and pages per layer.
        device: from :func:`engine_device`.
        kvtier: register with kvtierd (else a private cache, no link).
        copy_mode: ``daemon`` or ``engine`` (module docstring).
        client_config / model_id: where the daemon is; the namespace's model.
        staging_pages / staging_wait_s: the staging area's size and longest wait (``engine``).
        cuda_backend: ``daemon`` mode's CUDA operations for a :class:`CudaKVPool` (None: torch
            and CuPy on a CUDA device). Given one, the pool is a CUDA pool whatever ``device``
            is: a fake backend runs that branch over CPU tensors without a GPU.

    Raises:
        DaemonUnavailable / DaemonError / UnexpectedReply: REGISTER failed; nothing is left.
    """
    if not kvtier:
        return EngineKV(*new_kv_cache(cfg, num_pages, geometry.page_size, device))
    closers: list[Callable[[], object]] = []
    try:
        if copy_mode == "daemon":
            pool: SharedKVPool | CudaKVPool
            if cuda_backend is not None or device.type == "cuda":
                gpu = device if device.type == "cuda" else "cuda"  # a fake backend's GPU
                pool = CudaKVPool(geometry, num_pages, device=gpu, backend=cuda_backend)
            else:
                pool = SharedKVPool(geometry, num_pages)
            closers.append(pool.close)
            conn = Connection(pool, model_id, config=client_config)
            closers.insert(0, conn.close)
            return EngineKV(pool.k, pool.v, conn, closers)
        k_cache, v_cache = new_kv_cache(cfg, num_pages, geometry.page_size, device)
        staged = StagedConnection.over(
            [t for kv in zip(k_cache, v_cache) for t in kv],
            geometry,
            model_id,
            staging_pages=staging_pages,
            wait_s=staging_wait_s,
            config=client_config,
        )
        closers.insert(0, staged.close)
        return EngineKV(k_cache, v_cache, staged, closers)
    except BaseException:
        EngineKV([], [], None, closers).close()
        raise
