"""``kvtier bench trace``: the figures it prints are the daemon's real hit rates, or it fails.

Each case runs ``kvtier bench trace`` as a real subprocess (its own kvtierd and engine
workers) on a tiny hand-made trace in the Mooncake JSONL format, with the expected figures
counted by hand / by a pure-Python leaf-only LRU (one engine, so the daemon sees the
trace's own order and its ``lru`` policy serves what the simulation counts).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_trace_bench_inputs import _bench

PY = sys.executable


def _write(path: Path, chains: list[list[int]], step_ms: int = 1) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": i * step_ms,
                    "input_length": 512 * len(c),
                    "output_length": 1,
                    "hash_ids": c,
                }
            )
            + "\n"
            for i, c in enumerate(chains)
        )
    )
    return path


def _ref_lru(chains: list[list[int]], cap: int) -> float:
    """Leaf-only LRU, every request's blocks inserted after it runs, tail touched first."""
    res: dict[int, int] = {}
    par: dict[int, int | None] = {}
    clock = hits = total = 0
    for ch in chains:
        total += len(ch)
        for b in ch:
            if b not in res:
                break
            hits += 1
        for i, b in enumerate(ch):
            if b not in res:
                res[b] = 0
                par[b] = ch[i - 1] if i else None
        for b in reversed(ch):
            clock += 1
            res[b] = clock
        while len(res) > cap:
            inner = {par[b] for b in res if par.get(b) is not None}
            victim = min((b for b in res if b not in inner), key=lambda b: res[b])
            del res[victim]
            par.pop(victim, None)
    return hits / total


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, cmdline) of the direct children of ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append((int(d), cmd))
    return out


def _pages_stored(daemon: int, want: int, deadline: float) -> bool:
    """Wait until the daemon ``daemon`` (pid) holds ``want`` ready pages (its runtime
    directory read from its environment, its STATS asked over its admin socket)."""
    from kvtier.client.connection.admin import AdminClient
    from kvtier.config import socket_path

    env = Path(f"/proc/{daemon}/environ").read_bytes().split(b"\0")
    rd = next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"KVTIER_RUNTIME_DIR="))
    while time.monotonic() < deadline:
        try:
            with AdminClient(f"ipc://{socket_path(Path(rd))}") as admin:
                if int(admin.stats()["pool"]["pages_ready"]) >= want:
                    return True
        except Exception:  # not answering yet
            pass
        time.sleep(0.05)
    return False


@pytest.mark.timeout(120)
def test_block_ids_at_or_above_2_63_are_replayed(tmp_path: Path) -> None:
    """docs/benchmarks.md: only a block id outside [0, 2**64) is refused (load_trace checks
    ``0 <= b < 1 << 64``); hash ids are 64-bit hashes, so half of all ids are >= 2**63.
    A trace of three identical requests [2**63+5, 2**63+6] with one engine and a 4-page
    pool replays, exits 0, and reports the hit rate an LRU counts: 4 of 6 blocks."""
    big = 1 << 63
    trace = _write(tmp_path / "t.jsonl", [[big + 5, big + 6]] * 3)
    out = tmp_path / "r.json"
    args = ["--trace", str(trace), "--blocks", "4", "--engines", "1", "--speedup", "100000"]
    r = _bench(tmp_path, *args, "--policy", "lru", "--json", str(out))
    assert r.returncode == 0, r.stderr[-800:]
    res = json.loads(out.read_text())
    assert res["mismatched_bytes"] == 0
    assert res["hit_rate"] == [pytest.approx(4 / 6, abs=1e-4)]
    assert res["lru_hit_rate"] == [pytest.approx(4 / 6, abs=1e-4)]


@pytest.mark.timeout(120)
def test_daemon_dying_mid_replay_fails_the_bench_not_counted_as_misses(tmp_path: Path) -> None:
    """replay.py / TraceBenchError: "The replay could not run (a worker or the daemon
    failed ...)". When the bench's own kvtierd dies during the replay, the bench fails
    (exit 2, one line) rather than print every request after the death as a miss."""
    chains = [[1, 2, 3, 100 + i] for i in range(300)]
    trace = _write(tmp_path / "slow.jsonl", chains, step_ms=20)  # ~6 s at --speedup 1
    args = ["--trace", str(trace), "--blocks", "50", "--engines", "1", "--speedup", "1"]
    out = tmp_path / "r.json"
    p = subprocess.Popen(
        [PY, "-m", "kvtier.cli.main", "bench", "trace", *args, "--policy", "lru"]
        + ["--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        daemon = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            kids = _children(p.pid)
            ds = [pid for pid, cmd in kids if "kvtier.daemon" in cmd]
            ws = [pid for pid, cmd in kids if "kvtier.bench.trace.worker" in cmd]
            if ds and ws:
                daemon = ds[0]
                break
            time.sleep(0.05)
        assert daemon is not None, "the bench never started its daemon and worker"
        assert _pages_stored(daemon, 20, deadline), "the replay never stored 20 pages"
        os.kill(daemon, signal.SIGKILL)  # the replay is under way (it lasts ~6 s)
        stdout, stderr = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 2, (p.returncode, stdout[-600:], stderr[-600:])
    assert "Traceback" not in stderr, stderr[-600:]
    assert not out.exists(), out.read_text()[:400]


@pytest.mark.timeout(120)
def test_restart_bench_with_admin_token_in_environment(tmp_path: Path) -> None:
    """docs/metrics.md: the admin CLI takes ``$KVTIER_ADMIN_TOKEN``, and the daemon reads
    ``admin_token`` from the environment too: with ``KVTIER_ADMIN_TOKEN`` set in the caller's
    environment ``--restart`` still runs: exit 0, restart figures in the JSON."""
    chains = [[b] for b in range(1, 9)] * 3
    trace = _write(tmp_path / "t.jsonl", chains)
    out = tmp_path / "r.json"
    args = ["--trace", str(trace), "--blocks", "8", "--engines", "1", "--speedup", "100000"]
    r = _bench(
        tmp_path,
        *args,
        "--policy",
        "lru",
        "--restart",
        "--json",
        str(out),
        env={"KVTIER_ADMIN_TOKEN": "review-secret-token"},
    )
    assert r.returncode == 0, r.stderr[-800:]
    assert "Traceback" not in r.stderr
    res = json.loads(out.read_text())
    assert res["pages_adopted"] == [8]
    assert res["hit_rate_after_restart"] == res["hit_rate_after_no_restart"] == [1.0]


@pytest.mark.timeout(120)
def test_daemon_limit_from_environment_does_not_turn_into_fake_hit_rate(tmp_path: Path) -> None:
    """A trace valid for the docs, one engine, ``--policy lru``: the kvtier column is the
    hit rate of a pool of exactly N pages (the LRU simulation counts 0.5 here, and so does
    the daemon normally). With ``KVTIER_MAX_KEYS_PER_REQUEST=2`` in the caller's environment
    (a daemon setting, passed on to the bench's private kvtierd) every LOOKUP / STORE of a
    3-block chain would be refused; the bench either ignores the caller's limits for its own
    daemon (and reports 0.5) or fails, never prints 0.0 with exit 0 as the daemon's hit
    rate."""
    chains = [[1, 2, 3 + i] for i in range(4)]  # each request after the first hits 2 of 3
    trace = _write(tmp_path / "t.jsonl", chains)
    want = _ref_lru(chains, 16)
    assert want == pytest.approx(6 / 12)
    out = tmp_path / "r.json"
    args = ["--trace", str(trace), "--blocks", "16", "--engines", "1", "--speedup", "100000"]
    r = _bench(
        tmp_path,
        *args,
        "--policy",
        "lru",
        "--json",
        str(out),
        env={"KVTIER_MAX_KEYS_PER_REQUEST": "2"},
    )
    if r.returncode == 2:  # refused: fine
        assert "Traceback" not in r.stderr, r.stderr[-600:]
        return
    assert r.returncode == 0, r.stderr[-800:]
    res = json.loads(out.read_text())
    assert res["lru_hit_rate"] == [pytest.approx(want, abs=1e-4)]
    assert res["hit_rate"] == [pytest.approx(want, abs=1e-4)], res


@pytest.mark.timeout(60)
def test_pool_size_the_daemon_refuses_is_a_one_line_error(tmp_path: Path) -> None:
    """docs/benchmarks.md: "bad flags are refused with one line naming the file and line or
    the flag (exit 2)". ``--blocks 3000000000`` (12 TiB, more slots than the pool's index
    numbers) is refused by kvtierd at start; the bench says so in one line, exit 2."""
    trace = _write(tmp_path / "t.jsonl", [[1, 2], [1, 2]])
    args = ["--trace", str(trace), "--blocks", "3000000000", "--engines", "1"]
    r = _bench(tmp_path, *args, "--policy", "lru", timeout=50)
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-600:])
    assert "Traceback" not in err, err[-600:]
    assert len(err.splitlines()) == 1, err[-600:]


@pytest.mark.timeout(30)
def test_lirs_simulation_runs_at_capacity_one() -> None:
    """``python -m kvtier.bench.trace.policies --blocks N`` compares candidate policies; every
    candidate is a function ``(chains, capacity) -> hit rate`` for any capacity >= 1. On
    this valid prefix trace (each id names its prefix) with capacity 1, ``lirs_hit_rate``
    returns a rate in [0, MIN]."""
    from kvtier.bench.trace.policies import lirs_hit_rate
    from kvtier.bench.trace.sim import min_hit_rate

    chains = [[2, 3], [2, 3, 4], [2, 3, 4, 5, 6, 7, 9, 10, 11], [2, 3, 4, 5, 6, 12]]
    got = lirs_hit_rate(chains, 1)
    assert 0.0 <= got <= min_hit_rate(chains, 1) + 1e-12


@pytest.mark.timeout(120)
def test_one_engine_lru_matches_independent_lru_on_prefix_tree(tmp_path: Path) -> None:
    """With one engine and ``--policy lru`` on a valid prefix-tree trace,
    the daemon's hit rate and the printed LRU both equal an independent leaf-only LRU
    count, and the pool holds exactly N pages (N distinct blocks cycled: all hit from the
    2nd round at N pages, none at N-1)."""
    n = 67  # prime above 64: extents of one page
    chains = [[b] for b in range(1, n + 1)] * 3
    trace = _write(tmp_path / "t.jsonl", chains)
    out = tmp_path / "r.json"
    args = ["--trace", str(trace), "--blocks", f"{n},{n - 1}", "--engines", "1"]
    r = _bench(tmp_path, *args, "--speedup", "100000", "--policy", "lru", "--json", str(out))
    assert r.returncode == 0, r.stderr[-800:]
    res = json.loads(out.read_text())
    want = [round(_ref_lru(chains, n), 4), round(_ref_lru(chains, n - 1), 4)]
    assert want == [pytest.approx(2 / 3, abs=1e-4), 0.0]
    assert res["hit_rate"] == want and res["lru_hit_rate"] == want
