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
import numpy as np
from kvtier.daemon.pool.policies import GHOST_FACTOR, LIFE_QUANTILE


class GhostModel:
    """The ``reuse`` policy's lifetime, re-use distances, counts and ghosts, as the module
    docstring of :mod:`kvtier.daemon.pool.policies` states them."""

    def __init__(self, factor: float, quantile: float) -> None:
        self.factor, self.quantile = factor, quantile
        self.life = -1
        self.hist = [0] * 64
        self.capacity = 0
        self.evicted = [0, 0]
        self.ghost: OrderedDict[tuple[int, bytes], int] = OrderedDict()

    def observe(self, d: int) -> None:
        if d <= 0:
            return
        self.hist[d.bit_length() - 1] += 1
        n = sum(self.hist)
        if self.capacity <= 0 or n < self.capacity:
            return
        target, acc = self.quantile * n, 0.0
        for b in range(64):
            if acc + self.hist[b] >= target:
                break
            acc += self.hist[b]
        self.life = int(2.0**b * (1.0 + (target - acc) / self.hist[b]))
        self.hist = [h >> 1 for h in self.hist]

    def returning(self, ns: int, key: bytes, clock: int) -> bool:
        got = self.ghost.pop((ns, key), None)
        if got is None:
            return False
        self.observe(clock - (got >> 1))
        return True

    def record_eviction(self, k: int, ns: int, key: bytes, stamp: int, resident: int) -> None:
        self.evicted[k] += 1
        self.capacity = resident
        self.ghost[(ns, key)] = 2 * min(max(stamp, 0), 1 << 61) + k
        self.ghost.move_to_end((ns, key))
        while len(self.ghost) > self.factor * resident:
            self.ghost.popitem(last=False)

    def pick(self, s1: int | None, s2: int | None, clock: int, resident: int) -> int:
        if s2 is None:
            return 0
        if s1 is None:
            return 1
        life = self.life if self.life >= 0 else 4 * resident
        return 1 if clock - s2 > life and s2 < s1 else 0

    def ghost_list(self) -> list[tuple[int, int]]:
        return [(xxh3_64_intdigest(key, seed=ns), v) for (ns, key), v in self.ghost.items()]


def alike(core: _alloc.Reuse, model: GhostModel) -> None:
    assert core.life == model.life
    assert core.histogram() == model.hist
    assert core.capacity == model.capacity
    assert core.evicted == model.evicted
    assert core.ghosts == len(model.ghost)
    assert core.ghost_list() == model.ghost_list()


OPS = st.lists(
    st.tuples(
        st.integers(0, 3),  # 0: an eviction; 1: a store that may return a ghost; 2: a victim;
        st.integers(0, 2),  # 3: a LOAD's use; namespace
        st.integers(0, 40),  # key
        st.integers(0, 1),  # list
        st.integers(1, 12),  # resident pages
        st.integers(0, 1 << 20),  # a tick (a stamp, or how far the clock went on)
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(OPS)
def test_core_answers_as_the_model(ops: list[tuple[int, int, int, int, int, int]]) -> None:
    core = _alloc.Reuse(GHOST_FACTOR, LIFE_QUANTILE)
    model = GhostModel(GHOST_FACTOR, LIFE_QUANTILE)
    clock = 0
    stamp = np.zeros(4, dtype=np.int64)
    for op, ns, i, k, resident, tick in ops:
        key = b"key-%d" % i
        clock += tick % 4096
        if op == 0:
            core.record_eviction(k, ns, key, tick, resident)
            model.record_eviction(k, ns, key, tick, resident)
        elif op == 1:
            assert core.returning(ns, key, clock) == model.returning(ns, key, clock)
        elif op == 2:
            s1 = None if i % 7 == 0 else tick
            s2 = None if i % 5 == 0 else (tick * 31 + i) % (clock + 1)
            assert core.pick(s1, s2, clock, resident) == model.pick(s1, s2, clock, resident)
        else:
            stamp[k] = tick % (clock + 2)
            core.used(memoryview(stamp), [k], clock)
            model.observe(clock - int(stamp[k]))
        alike(core, model)
        assert core.lifetime(resident) == (model.life if model.life >= 0 else 4 * resident)


@pytest.mark.parametrize("resident", [3, 5000])
def test_core_through_growth_and_compaction(resident: int) -> None:
    """Tens of thousands of ghosts: the ring and table grow past their first sizes, most
    ghosts return (dropped entries to compact), and at ``resident`` 3 the FIFO bound pops
    all the time."""
    rng = random.Random(7)
    core = _alloc.Reuse(GHOST_FACTOR, LIFE_QUANTILE)
    model = GhostModel(GHOST_FACTOR, LIFE_QUANTILE)
    for step in range(60_000):
        key = b"%d" % rng.randrange(30_000)
        if rng.random() < 0.55:
            k = rng.randrange(2)
            core.record_eviction(k, 1, key, step, resident)
            model.record_eviction(k, 1, key, step, resident)
        else:
            assert core.returning(1, key, step) == model.returning(1, key, step)
        if step % 5000 == 0:
            alike(core, model)
    alike(core, model)
    assert core.ghosts == min(len(model.ghost), GHOST_FACTOR * resident)


def test_core_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ghost_factor"):
        _alloc.Reuse(0.0, LIFE_QUANTILE)
    with pytest.raises(ValueError, match="quantile"):
        _alloc.Reuse(GHOST_FACTOR, 1.0)
    core = _alloc.Reuse(GHOST_FACTOR, LIFE_QUANTILE)
    with pytest.raises(ValueError, match="at most 32 bytes, got 33"):
        core.returning(0, b"x" * 33, 1)
    with pytest.raises(ValueError, match="list must be 0 or 1, got 2"):
        core.record_eviction(2, 0, b"k", 1, 10)
    with pytest.raises(TypeError):
        core.returning(0, "not bytes", 1)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        core.life = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="int64"):
        core.used(b"\x00" * 7, [0], 1)
    with pytest.raises(ValueError, match="slot -1 is outside"):
        core.used(bytes(16), [0, -1], 5)
    assert core.histogram() == [0] * 64  # nothing counted before the check failed
    assert core.ghosts == 0 and core.evicted == [0, 0]
