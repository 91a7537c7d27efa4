"""The circuit breaker the remote L3 backends share, on a clock the test moves by hand."""

from __future__ import annotations

import logging

import pytest
from kvtier.daemon.storage.breaker import Breaker, BreakerState

pytestmark = pytest.mark.timeout(10)

LOGGER = "test.breaker"


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(threshold: int = 1, cooldown_s: float = 5.0) -> tuple[Breaker, Clock]:
    clock = Clock()
    breaker = Breaker(
        "test store",
        cooldown_s=cooldown_s,
        threshold=threshold,
        clock=clock,
        log=logging.getLogger(LOGGER),
    )
    return breaker, clock


def test_opens_after_threshold_consecutive_faults() -> None:
    breaker, _ = make(threshold=3)
    assert breaker.state is BreakerState.CLOSED and breaker.admit()
    breaker.failed("one")
    breaker.failed("two")
    assert breaker.state is BreakerState.CLOSED and breaker.admit() and not breaker.failing
    breaker.failed("three")
    assert breaker.state is BreakerState.OPEN and breaker.failing
    assert not breaker.admit()


def test_a_success_resets_the_fault_count() -> None:
    breaker, _ = make(threshold=2)
    breaker.failed("one")
    breaker.succeeded()
    breaker.failed("two")
    assert breaker.state is BreakerState.CLOSED and breaker.admit()
    breaker.failed("three")
    assert breaker.state is BreakerState.OPEN


def test_half_open_after_the_cool_down_lets_one_operation_through() -> None:
    breaker, clock = make(cooldown_s=5.0)
    breaker.failed("down")
    clock.now += 4.9
    assert breaker.state is BreakerState.OPEN and not breaker.admit()
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.admit()  # the one try of this cool-down
    assert not breaker.admit()  # the next waits for the next cool-down
    clock.now += 5.0
    assert breaker.admit()


def test_a_fault_while_half_open_starts_a_new_cool_down() -> None:
    breaker, clock = make(cooldown_s=5.0)
    breaker.failed("down")
    clock.now += 5.0
    assert breaker.admit()
    clock.now += 1.0
    breaker.failed("still down")
    clock.now += 4.9
    assert breaker.state is BreakerState.OPEN and not breaker.admit()
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN and breaker.admit()


def test_a_success_closes_it() -> None:
    breaker, clock = make(cooldown_s=5.0)
    breaker.failed("down")
    clock.now += 5.0
    assert breaker.admit()
    breaker.succeeded()
    assert breaker.state is BreakerState.CLOSED and not breaker.failing
    assert all(breaker.admit() for _ in range(3))


def test_zero_cool_down_never_refuses() -> None:
    breaker, _ = make(cooldown_s=0.0)
    breaker.failed("down")
    assert breaker.failing
    assert breaker.admit() and breaker.admit()


def test_logs_once_per_failing_spell(caplog: pytest.LogCaptureFixture) -> None:
    breaker, clock = make(cooldown_s=1.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            breaker.failed("connection refused")
            clock.now += 2.0
            breaker.admit()
        breaker.succeeded()
        breaker.succeeded()
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert "test store" in caplog.records[0].getMessage()
    assert "connection refused" in caplog.records[0].getMessage()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold=0"):
        Breaker("x", cooldown_s=1.0, threshold=0)
    with pytest.raises(ValueError, match="cooldown_s=-1"):
        Breaker("x", cooldown_s=-1.0)
