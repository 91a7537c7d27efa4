"""kvtier as SGLang's HiCache storage backend: one shared, restart-proof L2 (and L3) per node.

SGLang loads this class with its own dynamic loader::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.client.adapters.sglang", "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1, "allocator": "shm", "hicache_storage_pass_prefix_keys": true}'

and calls it from its HiCache threads (``interface_v1``): ``batch_exists`` (prefetch thread,
also the scheduler in PD decode), ``batch_get_v1`` (prefetch I/O thread) and
``batch_set_v1`` (backup thread). Pages move between SGLang's host pool and kvtierd's pool
without passing through this process: with ``"allocator": "shm"`` the host pool is a
memfd, handed to kvtierd once at registration (:mod:`.host_pool`), and STORE / LOAD
name host pages by index (host index ``i`` is page ``i // page_size``)::

    batch_exists(keys)   LOOKUP → leading run in L2, then in L3; if L3 holds part of it,
                         PREFETCH starts reading that part into L2 now
    batch_get_v1(keys)   LOAD the L2 run into SGLang's host pages; where a prefetch is on
                         its way, LOAD again as pages arrive, until SGLang's prefetch
                         timeout; True only for pages really loaded
    batch_set_v1(keys)   STORE from SGLang's host pages and wait; the MLA ranks that are not
                         SGLang's storage writer answer True without storing

Keys: SGLang's 64-hex page hashes, as 32 bytes. Each STORE also carries the hash SGLang's
own KV events give each page (``hash_str_to_int64`` of its key), so kvtierd's events name
pages as SGLang's do and a router matches them (for requests without a LoRA adapter or a
cache salt: SGLang's events name those by other hashes, which its storage keys do not carry). kvtierd's namespace adds what they lack:
model, KV dtype and geometry from the host pool (with the layout), the TP rank for MHA
(MLA pages are the same on every rank), tenant and cache salt; pipeline and context-parallel
positions join the model name. kvtierd answers LOOKUP with the minimum over the ranks of a
TP group, so every rank sees the same hit count.

Failures never reach SGLang: every call answers misses (0, False) when kvtierd is absent,
gone, restarting or refuses; the connection sees a dead daemon's process gone before each
request and within 20 ms while waiting for a reply, so such misses come within
milliseconds, and it registers again on its own once a daemon is back (:mod:`~kvtier.client.adapters.daemon_link`). Only a misconfiguration is an error, raised at start:
an unknown extra-config key, or a host pool kvtierd cannot reach (no ``"allocator": "shm"``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from kvtier.client.adapters.daemon_link import DaemonLink
from kvtier.client.adapters.sglang.host_pool import HostPoolMemory, describe_host_pool
from kvtier.client.adapters.sglang.settings import (
    BackendSettings,
    SettingsError,
    prefetch_timeout,
)
from kvtier.client.connection.connection import Connection
from kvtier.ipc import protocol as P
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.utils import hash_str_to_int64

__all__ = ["KvtierHiCacheStorage"]

log = logging.getLogger("kvtier.sglang")

_T = TypeVar("_T")

MAX_TRACKED_KEYS = 65536
"""Keys of started prefetches remembered (with their deadline) for ``batch_get_v1``."""

POLL_FIRST_S, POLL_MAX_S = 0.0005, 0.008
"""How often ``batch_get_v1`` looks again for pages a prefetch is bringing into L2."""

RECHECK_S = 0.5
"""How often ``batch_get_v1``, waiting for a page a prefetch brings, asks whether it is
still coming (a read that failed brings nothing: the wait ends there, not at the
prefetch's deadline)."""


def _key(key: str) -> bytes:
    """SGLang's page key as kvtier's 32 bytes (a 64-hex hash; anything else is hashed)."""
    if len(key) == 64:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest()


def _event_hashes(keys: Sequence[str], parent: str | None) -> P.EngineBlocks | None:
    """The hashes SGLang's own KV events give these pages (:func:`hash_str_to_int64` of
    each key, as its event recorder computes them); None for keys it cannot convert."""
    try:
        return P.EngineBlocks(
            hashes=[hash_str_to_int64(k) for k in keys],
            parent=None if parent is None else hash_str_to_int64(parent),
        )
    except ValueError:  # not a hex hash: SGLang publishes no such page
        return None


def _misses_on_error(
    default: Callable[..., _T],
) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Answer ``default(*args)`` instead of raising into SGLang.

    SGLang runs these calls on its HiCache threads and reduces hit counts across ranks; an
    exception there turns into a log line and a miss at best. A kvtier fault must cost a
    miss, never SGLang's thread, so it is logged (with its traceback at debug level),
    counted in ``counters["errors"]`` and answered as a miss.
    """

    def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(fn)
        def guarded(self: KvtierHiCacheStorage, *args: Any, **kwargs: Any) -> _T:
            try:
                return fn(self, *args, **kwargs)
            except Exception as err:  # the boundary to SGLang (see above)
                self.counters["errors"] += 1
                log.warning("kvtier %s failed, answered as a miss: %r", fn.__name__, err)
                log.debug("kvtier %s traceback", fn.__name__, exc_info=True)
                return default(self, *args, **kwargs)

        return guarded

    return wrap


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backend (``interface_v1``) backed by kvtierd.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; its ``extra_config`` carries the
            kvtier keys (:class:`~kvtier.client.adapters.sglang.settings.BackendSettings`).
        kwargs: what SGLang's dynamic loader passes besides (unused).

    Attributes:
        counters: calls, pages and misses seen (``lookups``, ``hit_pages``, ``loaded_pages``,
            ``stored_pages``, ``errors``, ...), for tests and debugging.

    Raises:
        SettingsError: an unknown key or bad value in the extra config.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        if not (storage_config.extra_config or {}).get("interface_v1"):
            raise SettingsError(
                'hicache storage extra config: the kvtier backend needs "interface_v1": 1 '
                "(SGLang then hands it host-pool pages to copy; without it SGLang copies "
                "through batch_get/batch_set, which kvtier answers as misses)"
            )
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.counters: Counter[str] = Counter()
        self._timeout = prefetch_timeout()
        self._memory: HostPoolMemory | None = None
        self._link: DaemonLink | None = None
        self._lock = threading.Lock()
        self._prefetching: OrderedDict[bytes, float] = OrderedDict()  # key → deadline

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Describe SGLang's host pool and register with kvtierd (or later, if it is away).

        Raises:
            HostPoolError: the host pool is not in shared memory or not describable.
        """
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.storage_config
        memory = describe_host_pool(mem_pool_host, mla=bool(cfg.is_mla_model))
        self._memory = memory
        client = self.settings.client
        if not client.tp_group and cfg.tp_size > 1:
            client = client.model_copy(update={"tp_group": _default_tp_group(cfg)})
        self._link = DaemonLink(
            lambda: memory.memory,
            _model_id(cfg, self.settings.model_id),
            client,
            cfg.tp_rank,
            cfg.tp_size,
            self.settings.retry_interval_s,
        )
        self._link.get()  # register now if kvtierd runs; else on a later call

    @property
    def connected(self) -> bool:
        """True while a kvtierd session is registered (tries to register if it is time)."""
        return self._conn() is not None

    @property
    def registrations(self) -> int:
        """Times the backend registered with a kvtierd (a restart makes one more)."""
        return self._link.registrations if self._link is not None else 0

    def close(self) -> None:
        """Unregister from kvtierd (SGLang calls this when it detaches the backend)."""
        if self._link is not None:
            self._link.close()

    def _conn(self) -> Connection | None:
        return self._link.get() if self._link is not None else None

    def _pages(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        """Host page numbers of the ``n`` pages at ``host_indices`` (None: not page-aligned)."""
        assert self._memory is not None
        ps = self._memory.page_size
        if host_indices.numel() != n * ps:
            log.warning(
                "kvtier: %d host indices for %d pages of %d tokens", host_indices.numel(), n, ps
            )
            return None
        first = host_indices.reshape(n, ps)[:, 0].to(torch.int64)
        if bool((first % ps != 0).any()):
            log.warning("kvtier: host indices not aligned to pages of %d tokens", ps)
            return None
        return (first // ps).tolist()

    # ------------------------------------------------------------------ interface_v1
    @_misses_on_error(lambda self, keys, *a, **k: 0)
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Leading pages of ``keys`` kvtierd holds (L2, then the L3 run a prefetch brings);
        starts reading the L3 part (an L3 run nothing will bring, below kvtierd's
        ``prefetch_threshold``, is not offered).

        The same on every TP rank (kvtierd answers the minimum over the rank group).
        """
        self.counters["lookups"] += 1
        conn = self._conn()
        if conn is None or not keys:
            return 0
        kb = [_key(k) for k in keys]
        rep = conn.lookup(kb)
        n = rep.l2
        if rep.l3:  # only what a prefetch brings (all of it, or as much as L2 can take)
            started = self._start_prefetch(conn, kb[: rep.l2 + rep.l3], rep.l2)
            if self.storage_config.tp_size > 1:
                # every rank answers the group's L3 run (the LOOKUP's, agreed): SGLang
                # decides per rank whether to look up its next batch, before it takes the
                # minimum, and the daemon pairs the ranks' LOOKUPs in order; what each
                # rank's own prefetch brings may differ (a page that does not come is then
                # recomputed, never waited for past its deadline)
                n += rep.l3
            elif started is not None:
                n += min(rep.l3, started[1])
        self.counters["hit_pages"] += n
        return n

    def _start_prefetch(
        self, conn: Connection, keys: Sequence[bytes], skip: int
    ) -> tuple[float, int] | None:
        """PREFETCH ``keys[skip:]`` from L3; remember the deadline of the pages coming.

        Returns:
            ``(deadline, pages coming)``, or None when nothing comes, neither by this
            prefetch nor by one already running (another request's or rank's).
        """
        coming = min(len(keys) - skip, conn.prefetch_coming(keys, skip=skip))
        if coming <= 0:
            return None
        assert self._memory is not None
        deadline = time.monotonic() + self._timeout.seconds(coming * self._memory.page_size)
        self.counters["prefetches"] += 1
        with self._lock:
            for k in keys[skip : skip + coming]:
                self._prefetching[k] = deadline
                self._prefetching.move_to_end(k)
            while len(self._prefetching) > MAX_TRACKED_KEYS:
                self._prefetching.popitem(last=False)
        return deadline, coming

    def _l3_deadline(self, conn: Connection, keys: Sequence[bytes], start: int) -> float | None:
        """Until when ``keys[start]`` may still arrive from L3 (None: it will not)."""
        now = time.monotonic()
        with self._lock:
            deadline = self._prefetching.get(keys[start])
        if deadline is not None and deadline > now:
            return deadline
        started = self._start_prefetch(conn, keys, start)
        return started[0] if started is not None else None

    @_misses_on_error(lambda self, keys, *a, **k: [False] * len(keys))
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load the leading pages of ``keys`` into SGLang's host pages at ``host_indices``.

        Returns:
            One flag per key, True only for pages whose bytes are in place (a leading run).
        """
        n = len(keys)
        out = [False] * n
        conn = self._conn()
        pages = self._pages(host_indices, n) if conn is not None and n else None
        if conn is None or pages is None:
            return out
        kb = [_key(k) for k in keys]
        got, deadline, delay, asked = 0, None, POLL_FIRST_S, 0.0
        while got < n:
            handle = conn.load(kb[got:], pages[got:])
            if handle.count:
                if not handle.wait_loaded():
                    # failed, cancelled or timed out: none of its pages count, and SGLang
                    # reuses them once this returns: not while kvtierd may still write them
                    handle.until_ended()
                    break
                got += handle.count
                continue
            # kb[got] is not in L2 (yet): wait for it only while a prefetch brings it
            now = time.monotonic()
            if deadline is None:
                deadline, asked = self._l3_deadline(conn, kb, got), now
            elif now - asked >= RECHECK_S:  # still coming? (a read that failed brings nothing)
                asked = now
                if conn.prefetch_coming(kb, skip=got) <= 0:
                    break
            if deadline is None or now >= deadline or not conn.daemon_alive():
                break
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
        out[:got] = [True] * got
        self.counters["loaded_pages"] += got
        self.counters["missed_pages"] += n - got
        return out

    @_misses_on_error(lambda self, keys, *a, **k: [False] * len(keys))
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store SGLang's host pages at ``host_indices`` under ``keys`` and wait.

        Returns:
            One flag per key: True for pages kvtierd now holds; all True without storing on
            an MLA rank that is not SGLang's storage writer (another rank stores them).
        """
        n = len(keys)
        if not self.storage_config.is_storage_writer:
            return [True] * n
        conn = self._conn()
        pages = self._pages(host_indices, n) if conn is not None and n else None
        if conn is None or pages is None:
            return [False] * n
        prefix = extra_info.prefix_keys if extra_info is not None else None
        handle = conn.store(
            [_key(k) for k in keys],
            pages,
            parent_key=_key(prefix[-1]) if prefix else None,
            engine=_event_hashes(keys, prefix[-1] if prefix else None),
        )
        ok = handle.wait() if handle.writing else True
        if not ok:  # SGLang reuses the pages once this returns: not while kvtierd reads them
            handle.until_ended()
        count = handle.count if ok else 0
        self.counters["stored_pages"] += count
        return [i < count for i in range(n)]

    # ------------------------------------------------------------------ the copying API
    # SGLang calls these only without interface_v1 (it copies each page into a tensor of
    # its own first). kvtier copies between host pools, so they answer misses; exists()
    # is a real lookup.
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        """A miss: kvtier loads into SGLang's host pool (``batch_get_v1``), not into tensors."""

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[None]:
        """Misses (see :meth:`get`)."""
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Not stored: kvtier stores from SGLang's host pool (``batch_set_v1``)."""
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Not stored (see :meth:`set`)."""
        return False

    def exists(self, key: str) -> bool:
        """Whether kvtierd holds the page (L2 or L3)."""
        return self.batch_exists([key]) == 1

    def clear(self) -> bool:
        """Not done here: ``kvtier flush`` drops cached pages (for every engine of the node)."""
        log.warning("kvtier: clearing the shared cache is an operator's job (`kvtier flush`)")
        return False


def _model_id(cfg: HiCacheStorageConfig, override: str | None) -> str:
    """The model name in kvtier's namespace, with the pipeline / context-parallel position."""
    model = override or cfg.model_name or "sglang"
    if cfg.pp_size > 1:
        model += f"@pp{cfg.pp_rank}of{cfg.pp_size}"
    if cfg.attn_cp_size > 1:
        model += f"@cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
    return model


def _default_tp_group(cfg: HiCacheStorageConfig) -> str:
    """A TP group name of this SGLang server's own and its data-parallel replica: its
    network namespace (servers in two containers on one node may both use the default port),
    its host address and its port, which every rank of one server shares."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        port, host = args.port, str(getattr(args, "host", "") or "")
    except (ImportError, ValueError, AttributeError):
        port, host = 0, ""
    try:
        netns = f"{os.stat('/proc/self/ns/net').st_ino:x}"
    except OSError:
        netns = "0"
    return f"sglang-{netns}-{host}-{port}-dp{cfg.dp_rank}"
