"""A daemon's configuration as its host pool's geometry (:meth:`HostPool.from_config`).

Without slot headroom, slots are 4 KiB-aligned; with it (an L3 backend that writes its
object header before each payload), payloads are 128-byte-aligned and extents keep the slot
ids of 4 KiB pages. Either way the pool's index numbers at most
:data:`~kvtier.daemon.pool.layout.MAX_SLOT_IDS` slots, which bounds ``hicache_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.config.errors import ConfigError
from kvtier.config.sizes import format_size
from kvtier.daemon.pool.layout import (
    HEADROOM_ALIGN,
    HEADROOM_MIN_PAGE_BYTES,
    MAX_SLOT_IDS,
    PoolLayout,
)

if TYPE_CHECKING:
    from kvtier.config import DaemonConfig

__all__ = ["geometry_of"]


def geometry_of(cfg: DaemonConfig, headroom: int) -> tuple[tuple[int, ...], dict[str, Any]]:
    """The arguments of :class:`~kvtier.daemon.pool.host_pool.HostPool` for ``cfg``.

    Args:
        cfg: the daemon's configuration (``hicache_size``, ``extent_size``,
            ``eviction_policy``).
        headroom: bytes before each payload for the L3 backend's object header (0: none).

    Returns:
        ``(args, kwargs)`` of the constructor.

    Raises:
        ConfigError: ``hicache_size`` cannot hold one extent with its headroom, or is so
            large that the index cannot number its slots (the message names the largest
            ``hicache_size`` allowed with this ``extent_size``).
    """
    if not headroom:
        _check_slot_ids(cfg, PoolLayout.max_capacity(cfg.extent_size))
        return (cfg.hicache_size, cfg.extent_size), {"eviction_policy": cfg.eviction_policy}
    _check_slot_ids(
        cfg,
        PoolLayout.max_capacity(cfg.extent_size, HEADROOM_ALIGN, HEADROOM_MIN_PAGE_BYTES, headroom),
    )
    span = cfg.extent_size + cfg.extent_size // HEADROOM_MIN_PAGE_BYTES * headroom
    if cfg.hicache_size < span:
        raise ConfigError(
            f"hicache_size ({cfg.hicache_size}) must hold at least one extent_size "
            f"({cfg.extent_size}) extent with its slots' headroom ({span} bytes in all) "
            f"when hicache_storage_backend is {cfg.hicache_storage_backend!r}"
        )
    kwargs = {
        "min_page_bytes": HEADROOM_MIN_PAGE_BYTES,
        "headroom": headroom,
        "eviction_policy": cfg.eviction_policy,
    }
    return (cfg.hicache_size, cfg.extent_size, HEADROOM_ALIGN), kwargs


def _check_slot_ids(cfg: DaemonConfig, largest: int) -> None:
    """Raise ConfigError when ``cfg.hicache_size`` exceeds ``largest`` (slot ids run out)."""
    if cfg.hicache_size > largest:
        raise ConfigError(
            f"hicache_size = {format_size(cfg.hicache_size)} ({cfg.hicache_size} bytes) is too "
            f"large: the pool's index numbers at most {MAX_SLOT_IDS} slots (one per 4 KiB), so "
            f"the largest hicache_size with extent_size {format_size(cfg.extent_size)} is "
            f"{format_size(largest)} ({largest} bytes)"
        )
