"""kvtier as a vLLM V1 KV connector: vLLM engines reuse prefixes through kvtierd.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier.client.adapters.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"runtime_dir": "/run/kvtier"}}'

vLLM makes one instance per role: the scheduler side (EngineCore process,
:class:`~kvtier.client.adapters.vllm.scheduler.SchedulerSide`) looks up and plans loads and
stores; the worker side (each worker, :class:`~kvtier.client.adapters.vllm.worker.WorkerSide`)
registers the KV memory and runs them. What the extra config keys mean:
:class:`~kvtier.client.adapters.vllm.settings.ConnectorSettings`; the user's guide is
``README.md ("Using kvtier with vLLM")``. One kvtier page is one vLLM block; the layout label ``vllm_cpu`` enters the
namespace. Two copy modes (``copy_mode`` in the extra config): ``daemon`` (the CPU default)
places vLLM's KV memory in a memfd kvtierd maps and copies; ``engine`` (the CUDA default)
leaves vLLM's allocation alone and copies pages through a staging area
(:mod:`~kvtier.client.adapters.vllm.staged_worker`). On other platforms the connector reports
misses and stores nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from kvtier.client.adapters.vllm.copy_mode import copy_mode_for, layout_for
from kvtier.client.adapters.vllm.metadata import KvtierMetadata
from kvtier.client.adapters.vllm.namespace import geometry_from_spec
from kvtier.client.adapters.vllm.scheduler import SchedulerSide
from kvtier.client.adapters.vllm.settings import ConnectorSettings
from kvtier.client.adapters.vllm.staged_worker import StagedWorkerSide
from kvtier.client.adapters.vllm.worker import WorkerSide
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KvtierConnector", "allow_amx"]

log = logging.getLogger("kvtier.vllm")


def allow_amx() -> bool:
    """Ask Linux for this process's AMX tile state, where the CPU has AMX; whether it is
    granted (False without AMX).

    vLLM's CPU attention runs AMX tile instructions (bfloat16 KV, blocks of a multiple of
    32 tokens) over cached context without asking for the tile state, and Linux gives it
    only to a process that asked (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, which torch's
    ``_init_amx`` makes): the first tile instruction of one that has not ends it with
    SIGILL. With the connector, a fresh engine's first request can be a hit loaded from
    kvtierd, its first forward pass then attends over cached context before anything in
    the process has asked, and the engine dies in ``cpu_attention_with_kv_cache``.
    """
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    init = getattr(torch.cpu, "_init_amx", None)
    if supported is None or init is None or not supported():
        return False
    return bool(init())


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector for kvtierd (both roles; see the module docstring).

    Args:
        vllm_config: vLLM's configuration (``kv_transfer_config.kv_connector_extra_config``
            holds the connector settings).
        role: scheduler or worker.
        kv_cache_config: vLLM's KV cache layout (one attention group is supported).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(tc.kv_connector_extra_config)
        if tc.kv_load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a kvtier load that fails (kvtierd "
                'stopped mid-load) fails its request; set it to "recompute" to '
                "recompute the blocks instead",
                tc.kv_load_failure_policy,
            )
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        model_id = self.settings.model_id or str(mc.model)
        revision = mc.revision or ""
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        platform = "cpu" if current_platform.is_cpu() else current_platform.device_type
        self.copy_mode = copy_mode_for(self.settings.copy_mode, platform)
        geometry = self._geometry(
            kv_cache_config, platform, self.copy_mode, str(vllm_config.cache_config.cache_dtype)
        )
        if geometry is None:
            return
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                geometry,
                self.settings,
                model_id,
                revision,
                pc.tensor_parallel_size,
                max_load_pages=(
                    StagedWorkerSide.load_capacity(self.settings.staging_pages)
                    if self.copy_mode == "engine"
                    else None
                ),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            assert kv_cache_config is not None
            if platform == "cpu":
                allow_amx()
            worker = StagedWorkerSide if self.copy_mode == "engine" else WorkerSide
            self._worker = worker(
                geometry,
                self.settings,
                model_id,
                revision,
                get_tensor_model_parallel_rank(),
                pc.tensor_parallel_size,
                kv_cache_config.kv_cache_tensors[0].size,
            )

    @staticmethod
    def _geometry(
        kv_cache_config: KVCacheConfig | None,
        platform: str,
        copy_mode: str | None,
        cache_dtype: str = "auto",
    ) -> Any:
        """The page geometry, or None (with a warning) for a setup kvtier does not serve."""
        if kv_cache_config is None or copy_mode is None:
            log.warning(
                'kvtier serves vLLM on the CPU and on CUDA (copy_mode "engine"), '
                "not %s; the connector is off",
                platform,
            )
            return None
        groups = kv_cache_config.kv_cache_groups
        sizes = {t.size for t in kv_cache_config.kv_cache_tensors}
        if len(groups) != 1 or not _full_attention(groups[0].kv_cache_spec) or len(sizes) != 1:
            log.warning("kvtier needs one full-attention KV cache group; the connector is off")
            return None
        try:
            return geometry_from_spec(
                groups[0].kv_cache_spec,
                len(groups[0].layer_names),
                layout_for(platform),
                cache_dtype,
            )
        except ValueError as err:
            log.warning("kvtier cannot store this KV cache (%s); the connector is off", err)
            return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True unless ``layerwise_loads`` is off: a hit in L2 then loads layer by layer
        (``wait_for_layer_load`` before each layer), and the replay of a full CUDA graph
        calls nothing between layers, so it would run over blocks not loaded yet. vLLM then
        captures its graphs piecewise, attention outside them."""
        return (extra_config or {}).get("layerwise_loads", True) is not False

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped store is a future miss, not a lost hand-off."""
        return False

    # ------------------------------------------------------------------ worker side
    def get_mem_pool_context(self) -> AbstractContextManager | None:
        """Place vLLM's KV allocation in a sealed memfd kvtierd can map (``daemon`` copy
        mode; None in ``engine`` mode: vLLM allocates as usual)."""
        return self._worker.allocation if self._worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV memory with kvtierd (regions, one per layer)."""
        if self._worker is not None:
            index = {name: extract_layer_index(name) for name in kv_caches}
            self._worker.register_kv_caches(kv_caches, index)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Let running stores of preempted requests end before their blocks are reused."""
        if self._worker is not None and isinstance(kv_connector_metadata, KvtierMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start the step's loads: layer-wise ones (hits in L2) now, before the forward;
        asynchronous ones (hits reaching into L3) on the I/O thread, ending through
        :meth:`get_finished`."""
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvtierMetadata)
            self._worker.start_loads(meta, idle=forward_context.attn_metadata is None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait until the step's layer-wise loads have put this layer's pages in place."""
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: full blocks are stored after the forward (:meth:`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """Queue the stores of the blocks this step filled (they run on the I/O thread)."""
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvtierMetadata)
            self._worker.start_stores(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose stores ended; requests whose asynchronous loads ended
        (the step's layer-wise loads have ended too when it returns)."""
        if self._worker is None:
            return None, None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks kvtier could not load (vLLM recomputes them)."""
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        """Unregister from kvtierd and release the memfd."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens kvtier holds beyond vLLM's own hit, and whether they load asynchronously
        (only hits that reach into L3 do, unless ``layerwise_loads`` is off)."""
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load into the blocks vLLM allocated."""
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(
                request, blocks.get_block_ids()[0], num_external_tokens
            )

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Split the hit into host memory (L2) and disk (L3) tokens."""
        if self._scheduler is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        split = self._scheduler.hit_sources(request, num_external_tokens)
        return {CacheHitSource(k): v for k, v in split.items()}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads and stores for the workers."""
        if self._scheduler is None:
            return KvtierMetadata()
        state = scheduler_output.kv_connector_block_state
        manager = self._kv_cache_manager

        def block_ids_of(req_id: str) -> list[int] | None:
            ids = state.get_block_ids(req_id) if state is not None else None
            if ids is None and manager is not None:
                ids = manager.get_block_ids(req_id)
            return ids[0] if ids else None

        return self._scheduler.build_meta(scheduler_output, block_ids_of)

    def update_connector_output(self, connector_output: Any) -> None:
        """Pages whose load failed are stored again once recomputed; the workers' KV
        events wait for :meth:`take_events`."""
        if self._scheduler is None:
            return
        if connector_output.invalid_block_ids:
            self._scheduler.loads_failed(set(connector_output.invalid_block_ids))
        if connector_output.kv_cache_events:
            self._scheduler.workers_events(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """``BlockStored`` (medium ``KVTIER``) of the blocks every worker stored in kvtierd
        since the last call; vLLM publishes them with its own events."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """This worker's KV events since the last step (its stores that ended)."""
        return self._worker.events.take() if self._worker is not None else None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while the workers still store from them."""
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request), None


def _full_attention(spec: Any) -> bool:
    """Whether a KV cache spec is plain full attention: every block of a request stays its
    own for the request's life. A sliding window or chunked local attention frees blocks
    out of the window (stores may still read them, loads would fill freed blocks); its
    subclasses (MLA, sinks, windows) lay pages out otherwise."""
    return (
        type(spec) is FullAttentionSpec
        and getattr(spec, "sliding_window", None) is None
        and getattr(spec, "attention_chunk_size", None) is None
    )
