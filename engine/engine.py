"""The reference engine: a :class:`TinyLlama` over a paged KV pool, with kvtier on, L1-only or off.

It serves one request at a time, the way an inference engine's scheduler would drive kvtier::

    match ─▶ alloc ─▶ load (L2 → pages, per layer) ─▶ prefill (layer i waits for layer i)
          ─▶ insert (+ write policy) ─▶ decode ─▶ release, free

Modes:
    ``on``: L1 radix tree plus kvtierd (L2, L3) through a :class:`Connection`.
    ``l1``: the L1 prefix cache alone (no daemon).
    ``off``: no caching at all; every prompt is computed in full (the baseline).

Only the prompt's full pages enter the cache. Decode tokens are never inserted: their pages
(and the prompt's partial last page, which decode keeps writing) are the request's own and are
freed when it ends. TTFT is measured from the start of :meth:`ReferenceEngine.generate` to the
first logits, so it includes the lookup, the allocation (and any eviction) and the load.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from kvtier.client.cache.manager import (
    CacheCounters,
    CacheManager,
    DevicePoolExhausted,
    LoadHandle,
    MatchResult,
)
from kvtier.client.cache.link import CacheLink
from kvtier.client.staging.area import check_staging_pages, check_wait_s
from kvtier.config import ClientConfig
from kvtier.config import client_config as load_client_config
from kvtier.engine.allocator import PageAllocator
from kvtier.engine.kv import (
    COPY_MODES,
    CopyMode,
    EngineKV,
    default_copy_mode,
    engine_device,
    open_kv,
)
from kvtier.engine.model import EngineInputError, ModelConfig, TinyLlama, new_kv_cache
from kvtier.client.connection.replies import DaemonError
from kvtier.ipc.cuda_backend import EngineCudaBackend
from kvtier.ipc.cuda_runtime import CudaIpcError
from kvtier.ipc.limits import DType
from kvtier.ipc.protocol import ErrorCode, Geometry

__all__ = ["EngineMode", "GenerationResult", "ReferenceEngine", "geometry_for", "model_id_for"]

EngineMode = Literal["on", "l1", "off"]
CacheFactory = Callable[..., CacheManager]
log = logging.getLogger("kvtier.engine")
_DTYPE_NAMES: dict[torch.dtype, DType] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


@dataclass(slots=True)
class GenerationResult:
    """What one :meth:`ReferenceEngine.generate` produced and where its prompt's KV came from.

    Attributes:
        tokens: the generated token ids (greedy).
        first_logits: float32 ``[vocab_size]`` logits of the prompt's last token.
        prompt_tokens: prompt length.
        cached_l1: prompt tokens whose KV was already on the device.
        cached_l2: prompt tokens whose KV was loaded from L2 and used.
        cached_l3: prompt tokens served from L3: loaded from L2 after a prefetch brought
            them there (the cache manager claims the prefetch it started at the match).
        l2_found / l3_found: tokens the lookup found in L2 / L3 after the L1 hit.
        computed: prompt tokens the prefill computed.
        ttft_s: seconds to the first logits (lookup, allocation and load included).
        load_failed: an L2 load failed part-way and the prompt was recomputed after L1.
    """

    tokens: list[int]
    first_logits: torch.Tensor
    prompt_tokens: int
    cached_l1: int
    cached_l2: int
    cached_l3: int
    l2_found: int
    l3_found: int
    computed: int
    ttft_s: float
    load_failed: bool

    @property
    def ttft_ms(self) -> float:
        """TTFT in milliseconds."""
        return self.ttft_s * 1000.0

    def summary(self) -> dict[str, object]:
        """Everything but the logits, as JSON-ready values."""
        return {
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_l1": self.cached_l1,
            "cached_l2": self.cached_l2,
            "cached_l3": self.cached_l3,
            "l2_found": self.l2_found,
            "l3_found": self.l3_found,
            "computed": self.computed,
            "ttft_ms": round(self.ttft_ms, 3),
            "load_failed": self.load_failed,
        }


def geometry_for(cfg: ModelConfig, page_size: int) -> Geometry:
    """The KV page geometry of ``cfg`` (MHA, layer_first).

    Args:
        cfg: the model.
        page_size: tokens per page.

    Returns:
        The geometry registered with the daemon.
    """
    if cfg.dtype not in _DTYPE_NAMES:
        raise EngineInputError(f"model dtype {cfg.dtype} has no KV geometry name")
    return Geometry(
        num_layers=cfg.n_layers,
        page_size=page_size,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        dtype=_DTYPE_NAMES[cfg.dtype],
    )


def model_id_for(cfg: ModelConfig) -> str:
    """A model id naming ``cfg`` exactly (shape, numerics and seed), so only equal weights share KV.

    Args:
        cfg: the model.

    Returns:
        ``kvtier-reference/<12 hex digits>``.
    """
    return "kvtier-reference/" + hashlib.sha256(repr(cfg).encode()).hexdigest()[:12]


class _LoadFailed(Exception):
    """Raised inside the forward pass when a layer's load failed; the prefill is redone."""


class _LayerGate:
    """The ``layer_wait`` of a prefill: waits for layer ``i`` of the load, aborts on failure."""

    __slots__ = ("_load",)

    def __init__(self, load: LoadHandle) -> None:
        self._load = load

    def __call__(self, layer: int) -> None:
        if not self._load.wait_layer(layer):
            raise _LoadFailed(layer)


def _refused_gpu_memory(err: DaemonError | CudaIpcError) -> bool:
    """Whether ``err`` says the daemon copy mode cannot work with this GPU memory: kvtierd
    refused it (BAD_MEMORY), or it cannot be exported; not a GPU out of memory, which the
    engine copy mode's own KV cache would meet too."""
    if isinstance(err, DaemonError):
        return err.code == ErrorCode.BAD_MEMORY
    return not isinstance(err.__cause__, torch.OutOfMemoryError)


class ReferenceEngine:
    """A single-request engine over a paged KV pool, with kvtier on, L1-only or off.

    With kvtier on, ``copy_mode`` says who copies pages between the engine's KV and kvtierd
    (:mod:`kvtier.engine.kv`): ``daemon`` (the KV is a pool the daemon maps: shared memory on
    the CPU, CUDA IPC on a GPU) or ``engine`` (plain device tensors, copied through a bounded
    staging area the daemon maps). Otherwise the KV is process-private memory of the same
    layout. Every tensor lives on ``device``, the model's.

    Args:
        model_config: the model (default :meth:`ModelConfig.default`); ignored when ``model``
            is given.
        mode: ``on`` (kvtierd), ``l1`` (local prefix cache only) or ``off`` (no caching).
        page_size: tokens per KV page.
        num_pages: device pages in the pool (prompt plus decode must fit one request; a
            load that fails while kvtierd lives keeps its pages until kvtierd ends it, so
            room for the loaded pages twice spares the recompute that wait).
        client_config: where the daemon is, timeouts, write policy.
        model: share an existing model (weights are read-only) instead of building one.
        model_id: namespace model id (default: :func:`model_id_for` of the config).
        cache_factory: builds the cache manager, called as ``(allocator, connection, config,
            page_size=...)``; a subclass can observe or inject faults.
        device: ``cpu`` (default) or a CUDA device; the model is moved there (a shared
            ``model`` must be there already).
        copy_mode: ``daemon`` or ``engine``. Default: :func:`~kvtier.engine.kv.default_copy_mode`
            (``daemon``, except on CUDA without CuPy); when that default is ``daemon`` over GPU
            memory and kvtierd refuses the memory (BAD_MEMORY: a kvtierd without a GPU or
            CuPy) or this process cannot export it, the engine logs a warning and uses
            ``engine``. ``copy_mode`` after construction is the mode in use.
        staging_pages: pages of the staging area (``engine`` mode): at most this many pages
            per load or store; more is computed or dropped, never more memory.
        staging_wait_s: longest wait for free staging pages (then a miss, or a dropped store).
        cuda_backend: the CUDA operations of ``daemon`` mode's CUDA pool (None: torch and
            CuPy); a fake one runs that pool over CPU tensors (tests without a GPU).

    Raises:
        EngineInputError: a bad mode, device, copy mode or staging size, or a model on
            another device.
        DaemonUnavailable / DaemonError / UnexpectedReply: mode ``on`` and the daemon is not
            there, refuses, or answers REGISTER with another reply.
    """

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        *,
        mode: EngineMode = "on",
        page_size: int = 64,
        num_pages: int = 256,
        client_config: ClientConfig | None = None,
        model: TinyLlama | None = None,
        model_id: str | None = None,
        cache_factory: CacheFactory = CacheManager,
        device: torch.device | str = "cpu",
        copy_mode: CopyMode | None = None,
        staging_pages: int = 64,
        staging_wait_s: float = 0.05,
        cuda_backend: EngineCudaBackend | None = None,
    ) -> None:
        if mode not in ("on", "l1", "off"):
            raise EngineInputError(f"mode must be 'on', 'l1' or 'off', got {mode!r}")
        self.device = engine_device(device)
        mode_of_copies = default_copy_mode(self.device) if copy_mode is None else copy_mode
        if mode_of_copies not in COPY_MODES:
            raise EngineInputError(f"copy_mode must be 'daemon' or 'engine', got {copy_mode!r}")
        try:
            check_staging_pages(staging_pages)
            staging_wait_s = check_wait_s(staging_wait_s, "staging_wait_s")
        except ValueError as err:
            raise EngineInputError(str(err)) from None
        self.copy_mode: CopyMode = mode_of_copies
        if model is None:
            model = TinyLlama(model_config or ModelConfig.default()).to(self.device)
        elif model.embed.device != self.device:
            raise EngineInputError(
                f"the model is on {model.embed.device}, the engine's device is {self.device}: "
                "move it first (model.to(device))"
            )
        self.model = model
        self.mode: EngineMode = mode
        self.page_size = page_size
        self.client_config = client_config or load_client_config()
        self.geometry = geometry_for(self.model.cfg, page_size)

        # Only a daemon needs to reach the KV: other modes keep it private. Shared memory is a
        # sealed memfd handed to kvtierd by descriptor: nothing is left in /dev/shm either way.
        def open_as(copies: CopyMode) -> EngineKV:
            return open_kv(
                self.model.cfg,
                self.geometry,
                num_pages,
                self.device,
                kvtier=mode == "on",
                copy_mode=copies,
                client_config=self.client_config,
                model_id=model_id or model_id_for(self.model.cfg),
                staging_pages=staging_pages,
                staging_wait_s=staging_wait_s,
                cuda_backend=cuda_backend,
            )

        gpu_pool = self.device.type == "cuda" or cuda_backend is not None
        fallback = copy_mode is None and self.copy_mode == "daemon" and gpu_pool
        why = ""
        try:
            self._kv: EngineKV = open_as(self.copy_mode)
        except (DaemonError, CudaIpcError) as err:
            if not (fallback and _refused_gpu_memory(err)):
                raise
            why = str(err)
        if why:  # outside the handler: its traceback would keep the first pool's memory alive
            log.warning(
                "copy_mode 'daemon' is not possible here (%s); using copy_mode 'engine'", why
            )
            self.copy_mode = "engine"
            self._kv = open_as("engine")
        self.k_cache, self.v_cache = self._kv.k_cache, self._kv.v_cache
        self.connection: CacheLink | None = self._kv.link
        self.allocator = PageAllocator(num_pages)
        self.cache: CacheManager | None = None
        self._closed = False
        try:
            if mode != "off":
                self.cache = cache_factory(
                    self.allocator, self.connection, self.client_config, page_size=page_size
                )
        except BaseException:
            self.close()
            raise

    @property
    def counters(self) -> CacheCounters | None:
        """The cache manager's counters (None when mode is ``off``)."""
        return self.cache.counters if self.cache is not None else None

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> GenerationResult:
        """Prefill ``prompt`` over whatever KV is cached, then decode greedily.

        Args:
            prompt: token ids, each in ``[0, vocab_size)``.
            max_new_tokens: tokens to generate (>= 0).

        Returns:
            The generated tokens, first logits, per-tier cached tokens, computed tokens, TTFT.

        Raises:
            EngineInputError: an empty prompt, a bad token id or a negative ``max_new_tokens``.
            DevicePoolExhausted: the pool cannot hold the request.
        """
        toks = [int(t) for t in prompt]
        vocab = self.model.cfg.vocab_size
        if not toks or min(toks) < 0 or max(toks) >= vocab:
            raise EngineInputError(f"prompt must be non-empty token ids in [0, {vocab})")
        if max_new_tokens < 0:
            raise EngineInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if self._closed:
            raise EngineInputError("the engine is closed")
        if self.cache is None:
            return self._generate_uncached(toks, max_new_tokens)
        return self._generate_cached(self.cache, toks, max_new_tokens)

    def warm_up(self, tokens: int = 256) -> None:
        """Run each model code path once (no prefix, cached prefix, decode) on scratch KV.

        The first call of each path pays one-time setup in torch; doing it here keeps that out
        of the first requests' TTFT. Touches neither the pool nor the cache.

        Args:
            tokens: prompt length of the warm-up (at least two pages are used).
        """
        size = self.page_size
        n = max(tokens, 2 * size + 1)
        pages = -(-(n + 1) // size)
        k, v = new_kv_cache(self.model.cfg, pages, size, self.device)
        table = list(range(pages))
        toks = [i % self.model.cfg.vocab_size for i in range(n)]
        self.model.prefill(toks, 0, table, k, v)
        self.model.prefill(toks, (n - 1) // size * size, table, k, v)
        self.model.decode(toks[-1], n, table, k, v)

    def flush_l1(self) -> int:
        """Evict every unlocked L1 page (write_back stores them first): L1 goes cold.

        Returns:
            Pages freed.
        """
        return self.cache.flush_l1() if self.cache is not None else 0

    def close(self) -> None:
        """Wait for stores in flight, unregister from the daemon, free the KV. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.cache is not None:
                self.cache.close()
        finally:
            self._kv.close()
            self.connection = None
            self.k_cache, self.v_cache = [], []

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _pages_for(self, n_prompt: int, max_new: int) -> int:
        # The last generated token is never fed back, so it needs no KV slot.
        return -(-(n_prompt + max(max_new - 1, 0)) // self.page_size)

    def _generate_uncached(self, toks: list[int], max_new: int) -> GenerationResult:
        t0 = time.perf_counter()
        n_pages = self._pages_for(len(toks), max_new)
        pages = self.allocator.alloc(n_pages)
        if pages is None:
            raise DevicePoolExhausted(f"{n_pages} pages needed, {self.allocator.free_count} free")
        try:
            logits = self.model.prefill(toks, 0, pages, self.k_cache, self.v_cache)
            ttft = time.perf_counter() - t0
            out = self._decode(toks, logits, pages, max_new)
        finally:
            self.allocator.free(pages)
        return GenerationResult(out, logits, len(toks), 0, 0, 0, 0, 0, len(toks), ttft, False)

    def _generate_cached(
        self, cache: CacheManager, toks: list[int], max_new: int
    ) -> GenerationResult:
        size, n = self.page_size, len(toks)
        t0 = time.perf_counter()
        m = cache.match(toks)
        owned: list[int] = []
        try:
            l1 = len(m.l1_pages)
            new = cache.alloc(self._pages_for(n, max_new) - l1)
            owned = list(new)
            load = cache.load(m, new[: m.l2_pages + m.l3_coming])
            table = m.l1_pages + new
            cached = l1 + load.pages
            logits = self._prefill(toks, cached * size, table, load)
            failed = logits is None
            if logits is None:
                logits, cached = self._recompute(cache, m, load, toks, table, owned), l1
            ttft = time.perf_counter() - t0
            computed = n - cached * size
            cache.record_computed(computed)
            n_full = n // size
            dups = cache.insert(m, table[:n_full])
            taken = set(table[l1:n_full]).difference(dups)
            owned = [p for p in owned if p not in taken]
            out = self._decode(toks, logits, table, max_new)
        finally:
            cache.release(m)
            # the tree's pages are its own, also if insert() raised after taking them
            cache.free([p for p in owned if not cache.tree.holds(p)])
        return GenerationResult(
            out,
            logits,
            n,
            l1 * size,
            min(cached - l1, m.l2_pages) * size,
            max(0, cached - l1 - m.l2_pages) * size,
            m.l2_tokens,
            m.l3_tokens,
            computed,
            ttft,
            failed,
        )

    def _prefill(
        self, toks: list[int], cached_len: int, table: list[int], load: LoadHandle
    ) -> torch.Tensor | None:
        """Prefill over the cached prefix; None when the load failed (nothing may be used)."""
        gate = _LayerGate(load) if load.pages else None
        try:
            logits = self.model.prefill(
                toks, cached_len, table, self.k_cache, self.v_cache, layer_wait=gate
            )
        except _LoadFailed:
            load.finish()
            return None
        return logits if load.finish() else None

    def _recompute(
        self,
        cache: CacheManager,
        m: MatchResult,
        load: LoadHandle,
        toks: list[int],
        table: list[int],
        owned: list[int],
    ) -> torch.Tensor:
        """Redo the prefill from the L1 boundary into pages no late load write can reach."""
        l1 = len(m.l1_pages)
        fresh = cache.recover_failed_load(load)
        if load.quarantined:  # the manager owns the old pages now; the request owns the fresh
            old = set(load.page_ids)
            owned[:] = [p for p in owned if p not in old] + fresh
        table[l1 : l1 + len(fresh)] = fresh
        return self.model.prefill(toks, l1 * self.page_size, table, self.k_cache, self.v_cache)

    def _decode(
        self, toks: list[int], logits: torch.Tensor, table: list[int], max_new: int
    ) -> list[int]:
        out: list[int] = []
        for step in range(max_new):
            out.append(int(logits.argmax()))
            if step + 1 < max_new:
                logits = self.model.decode(
                    out[-1], len(toks) + step, table, self.k_cache, self.v_cache
                )
        return out
