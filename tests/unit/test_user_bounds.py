"""The per-user bounds' pure parts: which spans get mapped, the use each user is charged,
users taking turns on the copy and prefault threads, and the series the metrics show."""

from __future__ import annotations

import mmap
import threading

import pytest
from kvtier.config import DaemonConfig, TenantConfig
from kvtier.daemon.service.metric_families import SnapshotCollector
from kvtier.daemon.service.quotas import LimitExceeded, Quotas, Use
from kvtier.daemon.transfer.fair_pool import FairExecutor
from kvtier.daemon.transfer.mapping_plan import MAP_GAP, Window, plan_windows
from kvtier.daemon.transfer.prefault import PrefaultQueue

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
G = mmap.ALLOCATIONGRANULARITY

pytestmark = pytest.mark.timeout(30)


# -- which spans are mapped ---------------------------------------------------------------


def test_a_huge_sparse_segment_maps_only_what_its_regions_span():
    assert plan_windows([64 * TiB], [(0, 0, 3 * MiB + 5)]) == [Window(0, 0, 3 * MiB + G)]


def test_spans_far_apart_get_a_mapping_each_and_near_ones_share_one():
    far = plan_windows([64 * TiB], [(0, 10 * TiB + 100, 4096), (0, 0, MiB)])
    assert far == [Window(0, 0, MiB), Window(0, 10 * TiB, 10 * TiB + 2 * G)]  # 4096 from 100
    near = plan_windows([GiB], [(0, 0, MiB), (0, MiB + MAP_GAP, MiB)])
    assert near == [Window(0, 0, 2 * MiB + MAP_GAP)]


def test_a_window_never_passes_its_segments_end_and_segments_stay_apart():
    sizes = [5000, 3 * MiB]
    assert plan_windows(sizes, [(1, MiB, 10), (0, 100, 4900)]) == [
        Window(0, 0, 5000),
        Window(1, MiB, MiB + G),
    ]


# -- what each user is charged -------------------------------------------------------------


def quotas(**cfg: object) -> Quotas:
    c = DaemonConfig(**cfg)
    return Quotas(lambda: c, physical=16 * GiB)


def test_the_mapped_byte_bound_is_per_user_and_names_itself():
    q = quotas(max_mapped_bytes_per_user="64MiB")
    q.check_mapping(1000, None, 40 * MiB, 1)
    q.add(1, 1000, None, 40 * MiB, 1)
    with pytest.raises(LimitExceeded) as err:
        q.check_mapping(1000, None, 40 * MiB, 1)
    assert err.value.setting == "max_mapped_bytes_per_user"
    assert "max_mapped_bytes_per_user = 64.0 MiB (67108864 bytes)" in str(
        err.value
    ) and "uid 1000" in str(err.value)
    q.check_mapping(2000, None, 60 * MiB, 1)  # another user's share is untouched
    q.remove(1)
    q.check_mapping(1000, None, 64 * MiB, 1)  # released with the session
    assert q.users == {} and q.mapped_bytes == 0
    assert q.refusals == {"max_mapped_bytes_per_user": 1}


def test_sessions_segments_and_the_total_have_their_own_bounds():
    q = quotas(max_sessions_per_user=2, max_mapped_segments_per_user=3, max_mapped_bytes="100MiB")
    q.add(1, 7, None, 10 * MiB, 2)
    q.add(2, 7, None, 10 * MiB, 1)
    with pytest.raises(LimitExceeded, match="max_sessions_per_user = 2 reached: uid 7"):
        q.check_session(7, None)
    with pytest.raises(LimitExceeded, match="max_mapped_segments_per_user = 3"):
        q.check_mapping(7, None, MiB, 1)
    with pytest.raises(LimitExceeded, match=r"max_mapped_bytes = 100.0 MiB"):
        q.check_mapping(8, None, 81 * MiB, 1)
    assert q.users[7] == Use(sessions=2, mapped_bytes=20 * MiB, mapped_segments=3)


def test_memory_waiting_to_be_unmapped_counts_against_the_total():
    """A closed session's memory not unmapped yet still takes address space: a REGISTER
    counts it against max_mapped_bytes, and the room for more to wait is what the open
    sessions leave."""
    waiting = [0]
    c = DaemonConfig(max_mapped_bytes="100MiB")
    q = Quotas(lambda: c, physical=16 * GiB, unmapping=lambda: waiting[0])
    q.add(1, 7, None, 30 * MiB, 1)
    assert q.unmap_room() == 70 * MiB
    q.check_mapping(8, None, 70 * MiB, 1)  # fits while nothing waits
    waiting[0] = 20 * MiB
    with pytest.raises(LimitExceeded, match=r"closed sessions not unmapped yet 20971520"):
        q.check_mapping(8, None, 70 * MiB, 1)
    q.check_mapping(8, None, 50 * MiB, 1)
    q.remove(1)
    assert q.unmap_room() == 100 * MiB  # the bound alone: what waits is the caller's to add
    q.add(2, 7, None, 120 * MiB, 1)  # above the bound (a lowered bound ends no session)
    assert q.unmap_room() == 0


def test_a_tenant_is_bounded_across_its_users():
    q = quotas(tenants={"a": TenantConfig(token="t", max_sessions=1, max_mapped_bytes="8MiB")})
    q.add(1, 10, "a", 6 * MiB, 1)
    with pytest.raises(LimitExceeded, match="tenant 'a': max_sessions = 1"):
        q.check_session(11, "a")  # another uid of the same tenant
    with pytest.raises(LimitExceeded, match=r"tenant 'a': max_mapped_bytes = 8.0 MiB"):
        q.check_mapping(11, "a", 4 * MiB, 1)
    q.check_session(11, "default")  # not a configured tenant: per-user bounds only


def test_the_defaults_follow_the_nodes_memory():
    lim = quotas().limits()
    assert lim["max_mapped_bytes_per_user"] == 32 * GiB
    assert lim["max_mapped_bytes"] == 128 * GiB
    assert (
        Quotas(lambda: DaemonConfig(), physical=64 * TiB).limits()["max_mapped_bytes"] == 32 * TiB
    )


# -- users take turns on the threads -------------------------------------------------------


def test_copy_threads_serve_users_in_turn():
    gate, started = threading.Event(), threading.Event()
    order: list[str] = []
    ex = FairExecutor(1, "test-copy")
    try:
        first = ex.submit_for(1, lambda: (started.set(), gate.wait(10)))  # holds the one thread
        assert started.wait(10)
        futs = [ex.submit_for(1, order.append, f"a{i}") for i in range(5)]
        futs.append(ex.submit_for(2, order.append, "b0"))
        assert ex.queued() == {1: 5, 2: 1}
        gate.set()
        for f in [first, *futs]:
            f.result(10)
        assert order == ["a0", "b0", "a1", "a2", "a3", "a4"]
    finally:
        ex.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        ex.submit(print)


def test_a_failing_copy_reaches_its_future_and_the_thread_goes_on():
    ex = FairExecutor(1)
    try:
        with pytest.raises(ZeroDivisionError):
            ex.submit(lambda: 1 // 0).result(10)
        assert ex.submit(lambda: 7).result(10) == 7
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


class Job:
    """A prefault job's shape (pending, step, label) that records its steps."""

    def __init__(self, name: str, steps: int, log: list[str], done: threading.Event) -> None:
        self.label, self.left, self.log, self.done = name, steps, log, done

    @property
    def pending(self) -> bool:
        return self.left > 0

    def step(self) -> bool:
        self.log.append(self.label)
        self.left -= 1
        if not self.left and self.label == "b":
            self.done.set()
        return self.pending


def test_prefault_steps_take_turns_between_users():
    log: list[str] = []
    done = threading.Event()
    q = PrefaultQueue(1)
    q.submit(Job("a", 50, log, done), user=1)  # type: ignore[arg-type]
    q.submit(Job("a2", 50, log, done), user=1)  # type: ignore[arg-type]
    q.submit(Job("b", 2, log, done), user=2)  # type: ignore[arg-type]
    assert q.queued() == {1: 2, 2: 1}
    q.start()
    try:
        assert done.wait(10)
        assert log[:4] == ["a", "b", "a2", "b"]  # user 2 waits one step of user 1, no more
    finally:
        q.close()


# -- what the metrics show -----------------------------------------------------------------


def test_the_limits_section_becomes_series_per_setting_and_user():
    snap = {
        "limits": {
            "bounds": {"max_mapped_bytes_per_user": 64 * MiB, "max_sessions_per_user": 128},
            "users": {
                "4343": {
                    "handover_connections": 3,
                    "handovers_waiting": 1,
                    "sessions": 2,
                    "mapped_bytes": 5 * MiB,
                    "mapped_segments": 2,
                }
            },
            "mapped_bytes": 5 * MiB,
            "refusals": {"max_mapped_bytes_per_user": 4},
            "shortages": 1,
        }
    }
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in SnapshotCollector(lambda: snap).collect()
        for s in fam.samples
    }
    assert got[("kvtier_limit", (("setting", "max_mapped_bytes_per_user"),))] == 64 * MiB
    for resource, value in snap["limits"]["users"]["4343"].items():
        assert got[("kvtier_user_use", (("resource", resource), ("uid", "4343")))] == value
    assert got[("kvtier_mapped_bytes", ())] == 5 * MiB
    assert got[("kvtier_limit_refusals_total", (("setting", "max_mapped_bytes_per_user"),))] == 4
    assert got[("kvtier_resource_shortages_total", ())] == 1


def test_every_bound_is_a_setting_with_a_description_and_bounds():
    fields = DaemonConfig.model_fields
    for name in quotas().limits():
        f = fields[name]
        assert f.description, name
        assert any(hasattr(m, "ge") for m in f.metadata), name
