"""SGLang 0.5.23's real HiCache classes on a CPU, without a server, driven by hand.

:func:`build_stack` publishes SGLang's runtime context from ``ServerArgs``, builds a device
KV pool, SGLang's host pool (its allocator chosen by SGLang's own ``get_allocator_type``
from the extra config: ``"allocator": "shm"`` makes it a memfd) and a ``HiCacheController``
whose storage backend SGLang's factory creates (``dynamic`` loads kvtier's backend; ``file``
is SGLang's ``HiCacheFile``). :meth:`Stack.backup` and :meth:`Stack.prefetch` then drive
the controller's own backup and prefetch threads the way SGLang's radix cache does. Used by
``kvtier bench sglang`` and by the SGLang tests.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

__all__ = ["Stack", "build_stack", "without_torchvision"]


def without_torchvision() -> None:
    """Let SGLang's config package import without torchvision.

    Publishing SGLang's runtime context imports ``sglang.srt.configs``, whose vision model
    configs import ``torchvision.transforms`` at module level; there is no CPU torchvision on
    PyPI for this torch, and HiCache never uses it. Where it is missing, the two names those
    modules import are provided (transformers is imported first, so it still sees
    torchvision as absent).
    """
    import enum
    import importlib.util
    import types

    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    import transformers.utils.import_utils  # noqa: F401  (caches: torchvision unavailable)

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    tv, tr = types.ModuleType("torchvision"), types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    tr.InterpolationMode = fn.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    tr.functional = fn  # type: ignore[attr-defined]
    tv.transforms = tr  # type: ignore[attr-defined]
    sys.modules.update(
        {"torchvision": tv, "torchvision.transforms": tr, "torchvision.transforms.functional": fn}
    )


@dataclass
class Stack:
    """A host pool and its HiCache controller (see :func:`build_stack`)."""

    host: Any
    controller: Any
    page: int
    timeout_s: float = 120.0
    pass_prefix_keys: bool = False  # hand SGLang's prefix keys over, as its radix cache does
    _rid: int = field(default=0)

    @property
    def backend(self) -> Any:
        """The storage backend SGLang created (possibly inside its fault injector)."""
        return self.controller.storage_backend

    def keys(self, tokens: list[int]) -> list[str]:
        """SGLang's storage keys of the full pages of ``tokens``."""
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        return list(get_storage_hash_str(tokens, None, page_size=self.page))

    def alloc(self, n_tokens: int) -> Any:
        """Host indices for ``n_tokens`` tokens (RuntimeError when the host pool is full)."""
        idx = self.host.alloc(n_tokens)
        if idx is None:
            raise RuntimeError(f"SGLang's host pool is full ({n_tokens} tokens asked)")
        return idx

    def backup(self, idx: Any, tokens: list[int], keys: list[str]) -> int:
        """Back the host pages ``idx`` up through the backup thread; tokens backed up."""
        cc = self.controller
        # a sequence from the root: no prefix keys, an empty list of them when they are passed
        prefix: list[str] | None = [] if self.pass_prefix_keys else None
        op_id = cc.write_storage(idx, tokens, hash_value=keys, prefix_keys=prefix)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                op = cc.ack_backup_queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError("the backup was not acknowledged") from None
            if op.id == op_id:
                return int(op.completed_tokens)

    def prefetch(self, tokens: list[int], before_reads: Any = None) -> tuple[Any, int, int, list]:
        """Prefetch ``tokens`` through the prefetch threads, as SGLang's radix cache does.

        Args:
            tokens: the request's tokens.
            before_reads: called with the host indices after the hit query, before the
                page reads are queued.

        Returns:
            ``(host indices or None, tokens the hit query found, tokens prefetched, keys of
            the prefetched pages)``; the caller frees the indices.
        """
        cc = self.controller
        self._rid += 1
        rid = f"r{self._rid}"
        op = cc.prefetch(rid, tokens, None, [] if self.pass_prefix_keys else None)
        deadline = time.monotonic() + self.timeout_s
        while cc.prefetch_hit_queue.get(timeout=max(0.01, deadline - time.monotonic())) is not op:
            pass
        hit = int(op.storage_hit_count)
        if hit == 0:
            return None, 0, 0, []
        idx = self.alloc(hit)
        if before_reads is not None:
            before_reads(idx)
        op.hash_value = op.hash_value[: hit // self.page]
        op.host_indices = idx
        cc.prefetch_buffer.put(op)
        done = 0
        while True:
            try:
                ack = cc.ack_prefetch_queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except Empty:
                raise TimeoutError("the prefetch did not complete") from None
            if ack.rid != rid:
                continue
            if ack.completed_tokens is not None:
                done = max(done, int(ack.completed_tokens))
            if ack.completed_req:
                return idx, hit, done, list(op.hash_value[: done // self.page])

    def close(self) -> None:
        """Detach the storage backend (stops the controller's storage threads)."""
        self.controller.detach_storage_backend()


def build_stack(
    layout: str,
    backend: str,
    extra: dict[str, Any],
    *,
    mla: bool = False,
    page_size: int = 16,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 64,
    device_tokens: int = 1024,
    host_tokens: int = 2048,
    tp_rank: int = 0,
    tp_size: int = 1,
    port: int = 30000,
    model: str = "test-model",
    host_memory_mode: str = "cache",
    publish: bool = True,
) -> Stack:
    """SGLang's host pool and HiCache controller with storage backend ``backend``.

    Args:
        layout: SGLang's ``--hicache-mem-layout``.
        backend: SGLang's ``--hicache-storage-backend`` (``dynamic`` for kvtier, ``file``).
        extra: ``--hicache-storage-backend-extra-config`` (a dict).
        mla: an MLA pool (latent 64 + rope 32) instead of MHA (``heads`` × ``head_dim``).
        publish: publish the runtime context (once per process; later stacks reuse it).
    """
    without_torchvision()
    import msgspec
    import torch
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    if publish:
        args = ServerArgs(
            model_path="dummy",
            device="cpu",
            enable_hierarchical_cache=True,
            hicache_storage_backend=backend,
            hicache_mem_layout=layout,
            page_size=page_size,
            hicache_storage_backend_extra_config=json.dumps(extra),
            tp_size=tp_size,
            port=port,
        )
        # the dummy model has nothing to resolve: mark it resolved (else SGLang loads it)
        msgspec.Struct.__setattr__(args, "_resolution_finished", True)
        rc.publish(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=tp_rank))
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.pool_host.common import get_allocator_type

    # the published config decides, as in SGLang; a later stack in the process says its own
    allocator_type = (
        get_allocator_type() if publish else "shm" if extra.get("allocator") == "shm" else "default"
    )
    host_kw = {
        "pin_memory": False,
        "device": "cpu",
        "allocator_type": allocator_type,
        "device_capacity_tokens": device_tokens,
        "start_layer": 0,
        "end_layer": layers - 1,
    }
    if mla:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        device = MLATokenToKVPool(
            device_tokens,
            page_size,
            torch.bfloat16,
            64,
            32,
            layers,
            "cpu",
            False,
            start_layer=0,
            end_layer=layers - 1,
        )
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            0,
            0,
            page_size,
            layout,
            target_layer_num=layers,
            host_token_capacity=host_tokens,
            **host_kw,
        )
    else:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        device = MHATokenToKVPool(
            device_tokens,
            page_size,
            torch.bfloat16,
            heads,
            head_dim,
            layers,
            "cpu",
            False,
            start_layer=0,
            end_layer=layers - 1,
        )
        host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            0,
            0,
            page_size,
            layout,
            host_token_capacity=host_tokens,
            **host_kw,
        )
    pool_allocator = PagedTokenToKVPoolAllocator(
        device_tokens, page_size, torch.bfloat16, "cpu", device, False
    )
    controller = HiCacheController(
        pool_allocator,
        host,
        page_size,
        tp_group=None,
        load_cache_event=threading.Event(),
        io_backend="direct",
        storage_backend=backend,
        model_name=model,
        storage_backend_extra_config=dict(extra),
        host_memory_mode=host_memory_mode,
    )
    return Stack(
        host=host,
        controller=controller,
        page=page_size,
        pass_prefix_keys=bool(extra.get("hicache_storage_pass_prefix_keys", False)),
    )
