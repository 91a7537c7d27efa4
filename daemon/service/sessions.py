"""Engine sessions: one per registered engine connection (one TP rank).

A session moves through OPEN → CLOSING → CLOSED. It closes on UNREGISTER, on disconnect
(ZeroMQ notifies the daemon), on lease expiry, or at daemon shutdown. While CLOSING it
accepts no request; its running transfers are cancelled, its prefetches are given up and
it leaves its tensor-parallel rank group; once the last transfer has finished its pins
are gone, its memory is unmapped and its completion block closed. The daemon never
removes anything of the engine's: it holds no name of the engine's memory.

A session whose request is waiting inside the daemon (a CLAIM waiting for its prefetch, a
rank waiting for the rest of its group) does not expire meanwhile: ``waiting`` counts such
requests, and the lease restarts when each of them is answered.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.ipc.completion import CompletionBlock
from kvtier.ipc.limits import MAX_PID
from kvtier.ipc.protocol import Geometry

if TYPE_CHECKING:
    from kvtier.daemon.tier.prefetch import PrefetchJob
    from kvtier.daemon.tier.rank_groups import Member
    from kvtier.daemon.transfer.cuda.executor import CudaSessionCopier
    from kvtier.daemon.transfer.cuda.memory import CudaEngineMemory
    from kvtier.daemon.transfer.engine_memory import EngineMemory, NoMemory
    from kvtier.daemon.transfer.transfer import Transfer


class SessionState(enum.Enum):
    """Lifecycle of a session."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(slots=True, eq=False)
class Session:
    """One registered engine (one TP rank).

    Attributes:
        session_id / identity: the session and the ZeroMQ identity of its connection.
        tenant / owner: the tenant it authenticated as and its pool owner id.
        ns_id / ns_fingerprint: its namespace (pool id, and the fingerprint that names
            its pages in L3).
        model_id: the model it named at registration.
        geometry / class_id: page shape and host-pool page class.
        memory / completion: the engine's mapped KV memory and completion block.
        pid / uid: the engine process and its user, as the kernel reported them on the
            memory handover (SO_PEERCRED), never as a message said; uid -1: not known.
        tp_rank / tp_size: the engine's tensor-parallel position.
        lease_s / deadline: lease length and expiry (monotonic).
        transfers: running transfers by completion slot.
        prefetches: unclaimed prefetches, by request id (or a chain's last key).
        member: its place in a TP rank group (None when ``tp_size`` is 1, and for a
            control-only session).
        control_only: it registered no memory (``memory.kind = "none"``): LOOKUP only.
        waiting: requests of this session being answered later (a claim, a group round).
        cuda: for ``memory.kind = "cuda_ipc"``, the session's copy stream and interprocess
            events (docs/gpu.md); None for every other session.
    """

    session_id: int
    identity: bytes
    tenant: str
    owner: int
    ns_id: int
    ns_fingerprint: bytes
    geometry: Geometry
    class_id: int
    memory: EngineMemory | NoMemory | CudaEngineMemory
    completion: CompletionBlock
    pid: int
    tp_rank: int
    tp_size: int
    lease_s: float
    uid: int = -1
    model_id: str = ""
    deadline: float = 0.0
    state: SessionState = SessionState.OPEN
    transfers: dict[int, Transfer] = field(default_factory=dict)  # by completion slot
    prefetches: dict[str | bytes, PrefetchJob] = field(default_factory=dict)
    member: Member | None = None
    control_only: bool = False
    waiting: int = 0
    cuda: CudaSessionCopier | None = None
    created: float = field(default_factory=time.time)

    def is_open(self) -> bool:
        """Whether the session still accepts requests."""
        return self.state is SessionState.OPEN

    def expired(self, now: float) -> bool:
        """Whether the lease ran out (never while a request of it is being answered)."""
        return self.waiting == 0 and self.deadline < now

    def renew(self, now: float) -> None:
        """Extend the lease from ``now``."""
        self.deadline = now + self.lease_s

    def engine_alive(self) -> bool:
        """Whether the engine's process still exists; never raises.

        An unknown pid (0 or less) counts as alive: only the lease can end such a session.
        A pid no process can have (above ``MAX_PID``) counts as dead, as does any pid
        ``os.kill`` refuses for a reason other than permission.
        """
        if self.pid <= 0:
            return True
        if self.pid > MAX_PID:
            return False
        try:
            os.kill(self.pid, 0)
        except PermissionError:  # someone else's process: it exists
            return True
        except (OSError, OverflowError):  # ProcessLookupError (gone) included
            return False
        try:  # a zombie is dead for our purposes
            with open(f"/proc/{self.pid}/stat", "rb") as fh:
                return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
        except (OSError, IndexError):
            return True

    def transition(self, new: SessionState) -> None:
        """Move to ``new``; only forward moves are allowed."""
        order = [SessionState.OPEN, SessionState.CLOSING, SessionState.CLOSED]
        if order.index(new) <= order.index(self.state):
            raise AssertionError(f"session {self.session_id}: {self.state.value} -> {new.value}")
        self.state = new


class SessionTable:
    """Sessions by id and by connection identity; ids come from a per-table counter."""

    __slots__ = ("_by_id", "_by_identity", "_next_id")

    def __init__(self) -> None:
        self._by_id: dict[int, Session] = {}
        self._by_identity: dict[bytes, set[int]] = {}
        self._next_id = 1

    def new_id(self) -> int:
        """Return a fresh session id."""
        sid = self._next_id
        self._next_id += 1
        return sid

    def add(self, s: Session) -> None:
        """Track ``s``."""
        self._by_id[s.session_id] = s
        self._by_identity.setdefault(s.identity, set()).add(s.session_id)

    def get(self, session_id: int) -> Session | None:
        """Return the session with that id, or None."""
        return self._by_id.get(session_id)

    def of_identity(self, identity: bytes) -> list[Session]:
        """Return the sessions registered over one connection."""
        return [self._by_id[i] for i in self._by_identity.get(identity, ())]

    def remove(self, s: Session) -> None:
        """Forget ``s``."""
        self._by_id.pop(s.session_id, None)
        ids = self._by_identity.get(s.identity)
        if ids is not None:
            ids.discard(s.session_id)
            if not ids:
                del self._by_identity[s.identity]

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)
