"""Which tenant each namespace belongs to, kept across restarts.

A tenant's scoped FLUSH of L3 deletes the objects of its namespaces (L3 objects are named by
namespace fingerprint, not by tenant), and a fingerprint's tenant is known from the
REGISTER that named it. So that a tenant can still flush its L3 data after kvtierd
restarted, before its engines register again, the map is saved to
``<state_dir>/tenant-namespaces.msgpack``: before the first L3 write that follows a new
namespace (so that no object of it is in L3 before the file names its tenant), a second
after a namespace is first seen (one write for a burst of registrations) and when the
daemon stops, and read back at start; an adopted pool's namespaces the file does not name
are added from the pool's owner table (:meth:`~kvtier.daemon.pool.host_pool.HostPool.namespace_tenants`).
While it cannot be saved (a full or read-only state_dir), no object of a namespace
registered since the last save is written to L3: the writer gives those pages up as it
does in an L3 outage,
HEALTH reports the failure, the save is tried again every :data:`SAVE_RETRY_S` seconds, and
the first one that succeeds queues the given-up pages again (:attr:`TenantNamespaces.on_saved`).

The file is read as untrusted input: bounded in size, decoded against the limits below, and
refused whole (logged, naming the file and what is wrong) on any error; the daemon then
starts without it. It holds at most :data:`MAX_ENTRIES` namespaces; past that the tenant
holding the most gives up its longest unseen one (one tenant's churn of namespaces pushes
out its own first, and another's only down to as many as the churner holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec
from kvtier.daemon.state_files import read_state_file

log = logging.getLogger("kvtier.daemon")

__all__ = ["DEFAULT_TENANT", "FILE_NAME", "MAX_ENTRIES", "TenantNamespaces"]

DEFAULT_TENANT = "default"
"""The tenant of every session when no tenants are configured."""
FILE_NAME = "tenant-namespaces.msgpack"
MAX_ENTRIES = 65536
"""Namespaces the file remembers at most (the latest seen)."""
SAVE_DELAY_S = 1.0
"""How long after a new namespace the map is written (the writes of a burst are one)."""
SAVE_RETRY_S = 5.0
"""How long after a failed save the next one is tried."""
_VERSION = 1
_FP = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
_NAME = Annotated[str, msgspec.Meta(max_length=256)]


class _Saved(msgspec.Struct, array_like=True):
    version: int
    fingerprints: Annotated[list[_FP], msgspec.Meta(max_length=MAX_ENTRIES)]
    tenants: Annotated[list[_NAME], msgspec.Meta(max_length=MAX_ENTRIES)]


class TenantNamespaces:
    """``fingerprint -> tenant`` of the namespaces engines registered, saved to ``path``.

    Args:
        path: the file (None: kept in memory only).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._map: dict[bytes, str] = _load(path) if path is not None else {}
        self._held = Counter(self._map.values())  # entries per tenant
        self._pending: asyncio.TimerHandle | None = None
        self._dirty = False  # a pair not saved yet
        self._unsaved: set[bytes] = set()  # fingerprints whose tenant the file may not name
        self.error: str | None = None
        """Why the last save failed (None: it did, or none was tried)."""
        self.on_saved: Callable[[], None] | None = None
        """Called when a save succeeds after one failed."""

    def note(self, fingerprint: bytes, tenant: str) -> None:
        """Remember that ``tenant`` registered ``fingerprint`` (the newest seen); a new
        pair is saved soon, and before the next L3 write (:meth:`on_disk`)."""
        old = self._map.pop(fingerprint, None)
        self._map[fingerprint] = tenant  # seen again: the newest
        if old == tenant:
            return
        if old is not None:
            self._held[old] -= 1
        self._held[tenant] += 1
        while len(self._map) > MAX_ENTRIES:
            self._drop_one()
        self._dirty = True
        if self.path is not None:
            self._unsaved.add(fingerprint)
        if self.path is not None and self._pending is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a test driving the tier directly): now
                self.save()
                return
            self._pending = loop.call_later(SAVE_DELAY_S, self.save)

    def _drop_one(self) -> None:
        """Forget the longest unseen namespace of the tenant that holds the most."""
        most = max(self._held, key=lambda t: self._held[t])
        fp = next(f for f, t in self._map.items() if t == most)
        del self._map[fp]
        self._unsaved.discard(fp)
        self._held[most] -= 1
        if not self._held[most]:
            del self._held[most]

    def learn(self, tenants: dict[bytes, str]) -> None:
        """Add the pairs of ``tenants`` (an adopted pool's) whose fingerprint is not known."""
        for fp, tenant in tenants.items():
            if fp not in self._map:
                self.note(fp, tenant)

    def on_disk(self, fingerprint: bytes) -> bool:
        """Whether an L3 write of namespace ``fingerprint`` may go ahead, saving first if a
        pair is not saved yet (its objects must never be in L3 while the file does not name
        its tenant): False only while saving fails and ``fingerprint`` is one of the pairs
        not saved."""
        if self._dirty and (self.error is None or self._pending is None):  # else: its timer
            self.save()
        return fingerprint not in self._unsaved

    def tenant_of(self, fingerprint: bytes) -> str | None:
        """The tenant that registered ``fingerprint`` last (None: not known)."""
        return self._map.get(fingerprint)

    def of(self, tenant: str | None) -> list[bytes]:
        """Fingerprints registered by ``tenant`` (None: by anyone)."""
        return [fp for fp, t in self._map.items() if tenant is None or t == tenant]

    def save(self, retry: bool = True) -> None:
        """Write the map now (atomically: a temporary file renamed over it, mode 0600); a
        failure is logged, the map stays in memory and (``retry``, on a running loop) the
        save is tried again :data:`SAVE_RETRY_S` seconds later."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self.path is None:
            return
        body = msgspec.msgpack.encode(_Saved(_VERSION, list(self._map), list(self._map.values())))
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())  # the rename below never names a file still empty
            os.replace(tmp, self.path)
        except OSError as err:
            with contextlib.suppress(OSError):  # also when state_dir is not a directory
                tmp.unlink(missing_ok=True)
            if self.error is None:  # once a spell: it is tried again before each L3 write
                log.warning(
                    "cannot save the tenants' namespaces to %s: %s; L3 writes of the "
                    "namespaces it does not name wait until it is saved",
                    self.path,
                    err,
                )
            self.error = (
                f"cannot save the tenants' namespaces to {self.path}: {err.strerror or err}"
            )
            if retry:
                with contextlib.suppress(RuntimeError):  # no loop: the caller's next call
                    loop = asyncio.get_running_loop()
                    self._pending = loop.call_later(SAVE_RETRY_S, self.save)
        else:
            self._dirty = False
            self._unsaved.clear()
            if self.error is not None:
                log.info("the tenants' namespaces are saved to %s again", self.path)
                self.error = None
                if self.on_saved is not None:
                    self.on_saved()


def _load(path: Path) -> dict[bytes, str]:
    """The saved map; empty when there is none or it is refused (logged)."""
    try:
        saved = msgspec.msgpack.decode(read_state_file(path, MAX_ENTRIES * 320 + 4096), type=_Saved)
        if saved.version != _VERSION:
            raise ValueError(f"version {saved.version}, not {_VERSION}")
        if len(saved.fingerprints) != len(saved.tenants):
            raise ValueError(
                f"{len(saved.fingerprints)} fingerprints but {len(saved.tenants)} tenants"
            )
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, msgspec.DecodeError) as err:
        log.warning("ignoring the tenants' namespaces in %s: %s", path, err)
        return {}
    return dict(zip(saved.fingerprints, saved.tenants, strict=True))
