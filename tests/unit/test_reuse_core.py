"""The ``reuse`` policy's C core (``_alloc.Reuse``, ``daemon/pool/native/_reuse.h``) op for op
against :class:`GhostModel`, the policy's rules in plain Python (an ordered dict of ghosts).

The core keeps its ghosts in a ring indexed by an open-addressing table; these tests drive
it through many more ghosts than its first ring and table hold (growth, compaction, deletion
by backward shift) and compare everything it answers after every step.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvtier.daemon.pool.native import _alloc
from kvtier.daemon.pool.policies import FLOOR, GHOST_FACTOR, SHADOW


class GhostModel:
    """The ``reuse`` policy's targets, counts and ghosts, as the module docstring of
    :mod:`kvtier.daemon.pool.policies` states them."""

    def __init__(self, factor: float, shadow: float, floor: float) -> None:
        self.factor, self.shadow, self.floor = factor, shadow, floor
        self.share = 1.0 - floor
        self.capacity = 0
        self.evicted = [0, 0]
        self.ghost: OrderedDict[tuple[int, bytes], int] = OrderedDict()

    def returning(self, ns: int, key: bytes) -> bool:
        got = self.ghost.pop((ns, key), None)
        if got is None:
            return False
        k, then = got & 1, got >> 1
        mine = self.share if k == 0 else 1.0 - self.share
        region = self.shadow * self.capacity * (1.0 - mine)
        if region > 0 and self.evicted[k] - then <= region:
            mine = min(mine + 1.0 / region, 1.0 - self.floor)
            self.share = mine if k == 0 else 1.0 - mine
        return True

    def record_eviction(self, k: int, ns: int, key: bytes, resident: int) -> None:
        self.evicted[k] += 1
        self.capacity = resident
        self.ghost[(ns, key)] = 2 * self.evicted[k] + k
        self.ghost.move_to_end((ns, key))
        while len(self.ghost) > self.factor * resident:
            self.ghost.popitem(last=False)

    def victim_list(self, resident: int, t2: int) -> int:
        if self.evicted == [0, 0]:  # the first eviction: the split the pool filled with
            self.share = min(max((resident - t2) / resident, self.floor), 1.0 - self.floor)
        return 0 if resident - t2 >= self.share * resident else 1

    def ghost_list(self) -> list[tuple[int, int]]:
        return [(xxh3_64_intdigest(key, seed=ns), v) for (ns, key), v in self.ghost.items()]


def alike(core: _alloc.Reuse, model: GhostModel) -> None:
    assert core.share == model.share
    assert core.capacity == model.capacity
    assert core.evicted == model.evicted
    assert core.ghosts == len(model.ghost)
    assert core.ghost_list() == model.ghost_list()


OPS = st.lists(
    st.tuples(
        st.integers(0, 2),  # 0: an eviction; 1: a store that may return a ghost; 2: a victim
        st.integers(0, 2),  # namespace
        st.integers(0, 40),  # key
        st.integers(0, 1),  # list
        st.integers(1, 12),  # resident pages
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(OPS)
def test_core_answers_as_the_model(ops: list[tuple[int, int, int, int, int]]) -> None:
    core = _alloc.Reuse(GHOST_FACTOR, SHADOW, FLOOR)
    model = GhostModel(GHOST_FACTOR, SHADOW, FLOOR)
    for op, ns, i, k, resident in ops:
        key = b"key-%d" % i
        if op == 0:
            core.record_eviction(k, ns, key, resident)
            model.record_eviction(k, ns, key, resident)
        elif op == 1:
            assert core.returning(ns, key) == model.returning(ns, key)
        else:  # i of the resident pages in T2
            core.t2 = t2 = min(i, resident)
            assert core.victim_list(resident) == model.victim_list(resident, t2)
        alike(core, model)


@pytest.mark.parametrize("resident", [3, 5000])
def test_core_through_growth_and_compaction(resident: int) -> None:
    """Tens of thousands of ghosts: the ring and table grow past their first sizes, most
    ghosts return (dropped entries to compact), and at ``resident`` 3 the FIFO bound pops
    all the time."""
    rng = random.Random(7)
    core = _alloc.Reuse(GHOST_FACTOR, SHADOW, FLOOR)
    model = GhostModel(GHOST_FACTOR, SHADOW, FLOOR)
    for step in range(60_000):
        key = b"%d" % rng.randrange(30_000)
        if rng.random() < 0.55:
            k = rng.randrange(2)
            core.record_eviction(k, 1, key, resident)
            model.record_eviction(k, 1, key, resident)
        else:
            assert core.returning(1, key) == model.returning(1, key)
        if step % 5000 == 0:
            alike(core, model)
    alike(core, model)
    assert core.ghosts == min(len(model.ghost), GHOST_FACTOR * resident)


def test_core_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ghost_factor"):
        _alloc.Reuse(0.0, SHADOW, FLOOR)
    with pytest.raises(ValueError, match="floor"):
        _alloc.Reuse(GHOST_FACTOR, SHADOW, 0.5)
    core = _alloc.Reuse(GHOST_FACTOR, SHADOW, FLOOR)
    with pytest.raises(ValueError, match="at most 32 bytes, got 33"):
        core.returning(0, b"x" * 33)
    with pytest.raises(ValueError, match="list must be 0 or 1, got 2"):
        core.record_eviction(2, 0, b"k", 10)
    with pytest.raises(TypeError):
        core.returning(0, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        core.share = 0.5  # type: ignore[misc]
    assert core.ghosts == 0 and core.evicted == [0, 0]
