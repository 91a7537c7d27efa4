"""Per-user and per-tenant bounds on what sessions make the daemon hold.

Any member of the daemon's group may register engines, and a registered engine makes the
daemon hold memory mappings (address space, page tables) as large as it declares. So
every such resource is counted per user id (the engine process's uid, from
``SO_PEERCRED`` on its handover, never from a message) and, where tenants are configured,
per tenant; a REGISTER that would take a user or tenant past its bound is refused with
BUSY, naming the setting, its value and what the request would have made it:

========================================  ==========================================
setting                                   counts
========================================  ==========================================
``max_sessions_per_user``                 sessions of one uid
``max_mapped_bytes_per_user``             bytes mapped for one uid's sessions
``max_mapped_segments_per_user``          mappings held for one uid's sessions
``max_mapped_bytes``                      bytes mapped for everyone (address space)
tenant ``max_sessions`` / ``max_mapped_bytes``  the same, per tenant (default: per user)
descriptors                               mappings of everyone: at most half the
                                          daemon's ``RLIMIT_NOFILE``
========================================  ==========================================

Each mapping of engine memory keeps a descriptor of its own for as long as it is mapped
(Python's ``mmap`` holds a duplicate of the descriptor it maps), so the mappings of all
sessions together are bounded by half the daemon's descriptor limit (the handover socket
takes the other half for the handovers waiting for their REGISTER).

The handover socket bounds its connections and waiting handovers per uid itself
(:mod:`~kvtier.daemon.service.handover`). Everything here runs on the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import DaemonConfig, KvtierError, format_size
from kvtier.daemon.service.strain import descriptor_limit

__all__ = ["LimitExceeded", "Quotas", "Use", "node_memory"]

MAX_DEFAULT_MAPPED = 32 << 40
"""The default ``max_mapped_bytes`` never exceeds this (a quarter of a 47-bit address space)."""


def node_memory() -> int:
    """The node's physical memory in bytes (``sysconf``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class LimitExceeded(KvtierError):
    """A request would take a user or tenant past a bound (the message names the setting).

    Attributes:
        setting: the configuration setting whose bound was reached.
    """

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


@dataclass(slots=True)
class Use:
    """What one user (or tenant) holds now."""

    sessions: int = 0
    mapped_bytes: int = 0
    mapped_segments: int = 0


@dataclass(frozen=True, slots=True)
class _Charge:
    uid: int
    tenant: str | None
    mapped_bytes: int
    mapped_segments: int


class Quotas:
    """The use of each user and tenant, checked against the configured bounds.

    Args:
        settings: returns the current configuration (a reload may change the bounds; a
            lowered bound refuses new sessions only, it ends none).
        physical: the node's memory in bytes (the defaults of the mapped-byte bounds).
        unmapping: bytes of closed sessions still mapped, waiting to be unmapped
            (:mod:`~kvtier.daemon.service.unmaps`): they count against ``max_mapped_bytes``
            with what open sessions map.
    """

    def __init__(
        self,
        settings: Callable[[], DaemonConfig],
        physical: int | None = None,
        unmapping: Callable[[], int] = lambda: 0,
    ) -> None:
        self._settings = settings
        self._physical = node_memory() if physical is None else physical
        self._unmapping = unmapping
        self.users: dict[int, Use] = {}
        self.tenants: dict[str, Use] = {}
        self.mapped_bytes = 0
        self.mapped_segments = 0
        self._charges: dict[int, _Charge] = {}
        self.refusals: dict[str, int] = {}
        """Requests refused, per setting."""

    # ------------------------------------------------------------------ bounds
    def limits(self) -> dict[str, int]:
        """The bounds in force, by setting name (defaults resolved)."""
        cfg = self._settings()
        return {
            "max_sessions_per_user": cfg.max_sessions_per_user,
            "max_mapped_bytes_per_user": (
                cfg.max_mapped_bytes_per_user
                if cfg.max_mapped_bytes_per_user is not None
                else 2 * self._physical
            ),
            "max_mapped_segments_per_user": cfg.max_mapped_segments_per_user,
            "max_mapped_bytes": (
                cfg.max_mapped_bytes
                if cfg.max_mapped_bytes is not None
                else min(8 * self._physical, MAX_DEFAULT_MAPPED)
            ),
            "max_handover_connections_per_user": cfg.max_handover_connections_per_user,
            "max_handover_connections": cfg.max_handover_connections,
            "max_handovers_waiting_per_user": cfg.max_handovers_waiting_per_user,
            "max_handovers_waiting": cfg.max_handovers_waiting,
            "max_handover_descriptors_per_user": cfg.max_handover_descriptors_per_user,
        }

    def _tenant_bounds(self, tenant: str | None) -> tuple[int, int] | None:
        """(sessions, mapped bytes) of a configured tenant, else None."""
        cfg = self._settings()
        t = cfg.tenants.get(tenant) if tenant is not None else None
        if t is None:
            return None
        lim = self.limits()
        return (
            t.max_sessions if t.max_sessions is not None else lim["max_sessions_per_user"],
            t.max_mapped_bytes
            if t.max_mapped_bytes is not None
            else lim["max_mapped_bytes_per_user"],
        )

    def _refuse(self, setting: str, message: str) -> LimitExceeded:
        self.refusals[setting] = self.refusals.get(setting, 0) + 1
        return LimitExceeded(setting, message)

    # ------------------------------------------------------------------ checks
    def check_session(self, uid: int, tenant: str | None) -> None:
        """Check that ``uid`` (and ``tenant``) may open one more session.

        Raises:
            LimitExceeded: naming ``max_sessions_per_user`` or the tenant's ``max_sessions``.
        """
        bound = self.limits()["max_sessions_per_user"]
        have = self.users.get(uid, Use()).sessions
        if have >= bound:
            raise self._refuse(
                "max_sessions_per_user",
                f"max_sessions_per_user = {bound} reached: uid {uid} holds {have} sessions",
            )
        tb = self._tenant_bounds(tenant)
        if tb is not None and self.tenants.get(tenant or "", Use()).sessions >= tb[0]:
            raise self._refuse(
                "tenants.max_sessions", f"tenant {tenant!r}: max_sessions = {tb[0]} reached"
            )

    def admitter(self, uid: int, tenant: str | None) -> Callable[[int, int], None]:
        """A check of (bytes, mappings) planned for a new session of ``uid`` / ``tenant``
        (the ``admit`` of :class:`~kvtier.daemon.transfer.engine_memory.EngineMemory`)."""

        def admit(nbytes: int, segments: int) -> None:
            self.check_mapping(uid, tenant, nbytes, segments)

        return admit

    def check_mapping(self, uid: int, tenant: str | None, nbytes: int, segments: int) -> None:
        """Check that mapping ``nbytes`` in ``segments`` mappings more stays in bounds.

        Raises:
            LimitExceeded: naming the setting, its value and the use it would reach.
        """
        lim = self.limits()
        use = self.users.get(uid, Use())
        bound = lim["max_mapped_bytes_per_user"]
        if use.mapped_bytes + nbytes > bound:
            raise self._refuse(
                "max_mapped_bytes_per_user",
                f"max_mapped_bytes_per_user = {format_size(bound)} ({bound} bytes) exceeded: "
                f"uid {uid} would map {format_size(use.mapped_bytes + nbytes)} (this session "
                f"{nbytes} bytes, its other sessions {use.mapped_bytes})",
            )
        bound = lim["max_mapped_segments_per_user"]
        if use.mapped_segments + segments > bound:
            raise self._refuse(
                "max_mapped_segments_per_user",
                f"max_mapped_segments_per_user = {bound} exceeded: uid {uid} would hold "
                f"{use.mapped_segments + segments} mappings (this session {segments})",
            )
        tb = self._tenant_bounds(tenant)
        if tb is not None:
            have = self.tenants.get(tenant or "", Use()).mapped_bytes
            if have + nbytes > tb[1]:
                raise self._refuse(
                    "tenants.max_mapped_bytes",
                    f"tenant {tenant!r}: max_mapped_bytes = {format_size(tb[1])} exceeded: it "
                    f"would map {format_size(have + nbytes)} (this session {nbytes} bytes)",
                )
        budget = descriptor_limit() // 2
        if self.mapped_segments + segments > budget:
            raise self._refuse(
                "descriptors",
                f"the sessions' mappings would hold {self.mapped_segments + segments} "
                f"descriptors (this session {segments}), more than half the daemon's limit "
                f"({budget * 2}, RLIMIT_NOFILE)",
            )
        bound = lim["max_mapped_bytes"]
        closing = self._unmapping()
        if self.mapped_bytes + closing + nbytes > bound:
            raise self._refuse(
                "max_mapped_bytes",
                f"max_mapped_bytes = {format_size(bound)} exceeded: all sessions would map "
                f"{format_size(self.mapped_bytes + closing + nbytes)} (this session {nbytes} "
                f"bytes{f', closed sessions not unmapped yet {closing}' if closing else ''})",
            )

    def unmap_room(self) -> int:
        """Bytes of closed sessions' memory that may wait to be unmapped now: what
        ``max_mapped_bytes`` leaves beside the open sessions' mappings."""
        return max(0, self.limits()["max_mapped_bytes"] - self.mapped_bytes)

    # ------------------------------------------------------------------ accounting
    def add(
        self, session_id: int, uid: int, tenant: str | None, nbytes: int, segments: int
    ) -> None:
        """Count an opened session's use (:meth:`remove` undoes it)."""
        assert session_id not in self._charges, f"session {session_id} counted twice"
        tenant = tenant if self._tenant_bounds(tenant) is not None else None
        self._charges[session_id] = _Charge(uid, tenant, nbytes, segments)
        for use in self._uses(uid, tenant):
            use.sessions += 1
            use.mapped_bytes += nbytes
            use.mapped_segments += segments
        self.mapped_bytes += nbytes
        self.mapped_segments += segments

    def remove(self, session_id: int) -> None:
        """Forget a finalized session's use (nothing when it was never counted)."""
        c = self._charges.pop(session_id, None)
        if c is None:
            return
        for use in self._uses(c.uid, c.tenant):
            use.sessions -= 1
            use.mapped_bytes -= c.mapped_bytes
            use.mapped_segments -= c.mapped_segments
        self.mapped_bytes -= c.mapped_bytes
        self.mapped_segments -= c.mapped_segments
        if self.users.get(c.uid) == Use():
            del self.users[c.uid]
        if c.tenant is not None and self.tenants.get(c.tenant) == Use():
            del self.tenants[c.tenant]

    def _uses(self, uid: int, tenant: str | None) -> list[Use]:
        uses = [self.users.setdefault(uid, Use())]
        if tenant is not None:
            uses.append(self.tenants.setdefault(tenant, Use()))
        return uses
