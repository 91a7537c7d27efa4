"""Tensor-parallel rank groups: every rank of one engine gets the same hit length.

A TP engine runs one process per rank, and each rank registers its own session. Its
ranks must agree on how many pages of a request come from the cache, or their forward
passes diverge; SGLang HiCache has them run ``all_reduce(min)`` on the hit length. Here
the daemon does that job: LOOKUP and CLAIM of a rank wait until every rank of its group
has asked, and all of them get the element-wise minimum of their answers.

Rounds are matched by order, as collectives are: the k-th LOOKUP of every rank forms
LOOKUP round k (likewise CLAIM), since the ranks of one engine run the same scheduler
decisions. A round ends when all ``tp_size`` ranks have contributed, or at its deadline
with the answer 0 for everyone (a rank that never asks must not hang the others)::

    rank 0  LOOKUP#7 ──▶ waits ────────────────┐
    rank 1  LOOKUP#7 ─────────▶ contributes ───┴─▶ both answered min(rank 0, rank 1)
    rank 1  LOOKUP#8 ──▶ waits ... deadline ──────▶ answered 0 (rank 0 never asked)
    rank 0  LOOKUP#8 (late) ──────────────────────▶ answered 0 at once (the round is over)

The deadline of a round is ``timeout_s`` after the latest expected contribution: each rank
says, on arrival, how long its own work may take (a CLAIM waits for its prefetch first).

A rank that joins a group whose other ranks are inside a round joins that round; else it
starts at the others' next round, so a restarted rank falls into step again.

A rank may also count its requests itself (``round`` in LOOKUP and CLAIM: 1, 2, ... per
operation, counting those it could not send, e.g. while its connection backs off after a
timeout or the daemon restarts). The ranks of one engine count alike, so the group maps
counts to rounds once, at the first counted request any of its ranks makes, and every
rank's k-th request meets the others' k-th: one a rank skipped leaves a gap instead of
shifting every later round against the other ranks'. A request counted before the group's
first round (a rank that reaches a restarted daemon after its peer's next request did) is
answered 0 at once. A rank that takes the place of a live one (a restarted engine whose old
sessions are still open) makes the group map counts anew from its next counted request,
unless it is the same process and its counts go on (a REGISTER whose reply was lost left
the session it replaces). A
rank whose session ended while its process was stopped (its lease ran out) registers again
saying its counts go on (REGISTER's ``counts_continue``): its counts keep their rounds, and
a request whose round ended meanwhile is answered at once with that round's answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvtier.daemon.pauses import WATCH, RunningTimer

log = logging.getLogger("kvtier.daemon.groups")

ROUND_TTL_S = 60.0
"""How long a round that ended without every rank is kept for its late ranks."""

MAX_STALE_ROUNDS = 4096
"""Ended rounds kept per group for late ranks, at most (the oldest are forgotten)."""


@dataclass(frozen=True, slots=True)
class GroupKey:
    """What names one TP engine: its ranks share every field.

    Attributes:
        uid: the user the ranks' processes run as (another user's session never joins an
            engine's group, nor takes a rank's place in it).
        tenant: the tenant the ranks authenticated as.
        model_id / revision / cache_salt: the model namespace.
        attention: ``mha`` or ``mla``.
        tp_size: ranks in the engine.
        tp_group: the engine's own group name (empty by default); engines of the same
            model and TP size on one node must set distinct names.
    """

    uid: int
    tenant: str
    model_id: str
    revision: str
    cache_salt: str
    attention: str
    tp_size: int
    tp_group: str


@dataclass(eq=False, slots=True)
class _Round:
    seq: int
    arity: int
    values: dict[int, tuple[int, ...]] = field(default_factory=dict)
    arrived: set[int] = field(default_factory=set)
    deadline: float = 0.0  # on the running clock: loop time less kvtierd's pauses
    timer: RunningTimer | None = None
    result: asyncio.Future[tuple[int, ...]] | None = None


@dataclass(eq=False, slots=True)
class Member:
    """One rank's place in its group (kept on its session).

    Attributes:
        group: the group.
        rank: the TP rank.
        session_id: the rank's session.
        seq: rounds entered so far, per operation.
        resumed: the rank's connection registered again with its counts going on (its
            session ended while its process was stopped): they alone place its requests.
        pid: the rank's process as the daemon saw it (0: not known).
    """

    group: RankGroup
    rank: int
    session_id: int
    seq: dict[str, int] = field(default_factory=dict)
    resumed: bool = False
    pid: int = 0


@dataclass(eq=False, slots=True)
class RankGroup:
    """The live ranks of one TP engine, their open rounds, and per operation the ranks
    count, the round minus the count (fixed by the first counted request of any rank)."""

    key: GroupKey
    members: dict[int, Member] = field(default_factory=dict)
    rounds: dict[tuple[str, int], _Round] = field(default_factory=dict)
    offset: dict[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Ranks the group needs for a round to complete (``tp_size``)."""
        return self.key.tp_size


class RankGroups:
    """Every TP group of the daemon; rounds end by all ranks or by deadline.

    Args:
        timeout_s: how long a round waits for missing ranks after the latest expected
            contribution (``tp_group_timeout_s``).
        on_round: called once per ended round with ``timed_out`` (for counters).
    """

    def __init__(self, timeout_s: float, on_round: Callable[[bool], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self._groups: dict[GroupKey, RankGroup] = {}
        self._on_round = on_round

    def __len__(self) -> int:
        return len(self._groups)

    def join(
        self,
        key: GroupKey,
        rank: int,
        session_id: int,
        counts_continue: bool = False,
        pid: int = 0,
    ) -> Member | None:
        """Add a rank's session to its group (None when ``tp_size`` is 1: nothing to agree).

        A session that takes the place of a live one with the same rank replaces it (the
        old engine process is presumed gone; its rounds stay as they are), unless both are
        of one process ``pid`` and its counts go on (a REGISTER whose reply never reached it
        left the session it replaces). A connection whose counts go on
        (``counts_continue``: its session ended while it was stopped, REGISTER's field)
        meets, with each counted request, the round its count maps to.
        """
        if key.tp_size <= 1:
            return None
        group = self._groups.setdefault(key, RankGroup(key))
        old = group.members.get(rank)
        if old is not None:
            log.warning(
                "tp group %s/%d: rank %d re-registered (session %d replaces %d)",
                key.model_id,
                key.tp_size,
                rank,
                session_id,
                old.session_id,
            )
        others = [m for r, m in group.members.items() if r != rank]
        own = old is not None and counts_continue and pid > 0 and old.pid == pid
        if old is not None and not own:  # another process's counts: they map to rounds anew
            group.offset.clear()
        resumed = counts_continue and (old is None or own)
        member = Member(group, rank, session_id, resumed=resumed, pid=pid)
        for op in {op for op, _ in group.rounds} | {op for m in others for op in m.seq}:
            open_rounds = [
                seq
                for (o, seq), rnd in group.rounds.items()
                if o == op
                and rnd.result is not None
                and not rnd.result.done()
                and rank not in rnd.arrived
            ]
            member.seq[op] = (
                min(open_rounds)
                if open_rounds
                else max((m.seq.get(op, 0) for m in others), default=0)
            )
        group.members[rank] = member
        return member

    def leave(self, member: Member) -> None:
        """Remove a rank's session (its group goes when its last rank has left)."""
        group = member.group
        if group.members.get(member.rank) is member:
            del group.members[member.rank]
        if not group.members:
            for rnd in group.rounds.values():
                if rnd.timer is not None:
                    rnd.timer.cancel()
                if rnd.result is not None and not rnd.result.done():
                    rnd.result.set_result((0,) * rnd.arity)
            group.rounds.clear()
            self._groups.pop(group.key, None)

    async def agree(
        self,
        member: Member,
        op: str,
        arity: int,
        compute: Callable[[], Awaitable[tuple[int, ...]]],
        wait_s: float = 0.0,
        count: int = 0,
    ) -> tuple[int, ...]:
        """Contribute this rank's answer to its next ``op`` round; return the group's.

        Args:
            member: the asking rank.
            op: the operation whose rounds are matched (``lookup``, ``claim``).
            arity: values in an answer; the answer is the element-wise minimum.
            compute: produces this rank's answer (not called when the round is already over).
            wait_s: how long ``compute`` may take; the round's deadline allows for it.
            count: the rank's own count of its ``op`` requests, this one included (0: it
                does not count; its rounds follow the order of arrival).

        Returns:
            The element-wise minimum over the group's ranks, or zeros when a rank did not
            contribute by the deadline.
        """
        group = member.group
        seq = member.seq.get(op, 0)
        if count > 0:  # requests a rank counted but never sent leave their rounds unused
            mapped = count + group.offset.setdefault(op, seq - count)
            if mapped < 0:  # older than the group's first round: no rank will meet it
                return (0,) * arity
            # a new connection's counts start again (behind the rounds: its place is the
            # others' next); a resumed one's go on, and a round of them may be over
            seq = mapped if member.resumed else max(seq, mapped)
        member.seq[op] = seq + 1
        rnd = group.rounds.get((op, seq))
        if rnd is None:
            ahead = [m.seq.get(op, 0) for m in group.members.values() if m is not member]
            if ahead and min(ahead) > seq:  # the others entered this round, now forgotten
                member.seq[op] = min(ahead)
                return (0,) * arity
            rnd = self._open(group, op, seq, arity)
        assert rnd.result is not None
        rnd.arrived.add(member.rank)
        if rnd.result.done():
            self._retire_if_complete(group, op, rnd)
            return rnd.result.result()
        loop = asyncio.get_running_loop()
        self._extend(group, op, rnd, loop.time() + wait_s + self.timeout_s)
        value = await compute()
        if not rnd.result.done():
            rnd.values[member.rank] = value
            if len(rnd.values) >= group.size:
                self._end(group, op, rnd, tuple(min(v) for v in zip(*rnd.values.values())))
        self._retire_if_complete(group, op, rnd)
        return await asyncio.shield(rnd.result)

    # ------------------------------------------------------------------ rounds
    def _open(self, group: RankGroup, op: str, seq: int, arity: int) -> _Round:
        rnd = _Round(seq=seq, arity=arity, result=asyncio.get_running_loop().create_future())
        group.rounds[(op, seq)] = rnd
        stale = [k for k, r in group.rounds.items() if r.result is not None and r.result.done()]
        for k in stale[: max(0, len(stale) - MAX_STALE_ROUNDS)]:
            del group.rounds[k]
        return rnd

    def _extend(self, group: RankGroup, op: str, rnd: _Round, deadline: float) -> None:
        """Move the round's end to loop time ``deadline`` unless it ends later already.
        Deadlines are compared on the running clock (loop time less kvtierd's pauses), on
        which the round's timer counts too: a pause before a later rank's arrival has
        moved the timer on, and a shorter deadline of that rank must not undo it."""
        now = asyncio.get_running_loop().time()
        ran = WATCH.catch_up()
        if deadline - ran <= rnd.deadline:
            return
        rnd.deadline = deadline - ran
        if rnd.timer is not None:
            rnd.timer.cancel()
        rnd.timer = RunningTimer(max(0.0, deadline - now), self._expire, group, op, rnd)

    def _expire(self, group: RankGroup, op: str, rnd: _Round) -> None:
        rnd.timer = None
        if rnd.result is not None and not rnd.result.done():
            missing = sorted(set(range(group.size)) - set(rnd.values))
            log.warning(
                "tp group %s/%d: %s round %d ended without rank(s) %s: answer 0",
                group.key.model_id,
                group.size,
                op,
                rnd.seq,
                missing,
            )
            self._end(group, op, rnd, (0,) * rnd.arity, timed_out=True)
            loop = asyncio.get_running_loop()
            loop.call_later(ROUND_TTL_S, self._forget, group, op, rnd)

    def _end(
        self,
        group: RankGroup,
        op: str,
        rnd: _Round,
        value: tuple[int, ...],
        timed_out: bool = False,
    ) -> None:
        assert rnd.result is not None
        rnd.result.set_result(value)
        if rnd.timer is not None:
            rnd.timer.cancel()
            rnd.timer = None
        if self._on_round is not None:
            self._on_round(timed_out)

    def _retire_if_complete(self, group: RankGroup, op: str, rnd: _Round) -> None:
        if rnd.result is not None and rnd.result.done() and len(rnd.arrived) >= group.size:
            self._forget(group, op, rnd)

    @staticmethod
    def _forget(group: RankGroup, op: str, rnd: _Round) -> None:
        if group.rounds.get((op, rnd.seq)) is rnd:
            del group.rounds[(op, rnd.seq)]
