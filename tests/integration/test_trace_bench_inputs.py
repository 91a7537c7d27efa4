"""``kvtier bench trace`` fed an operator's own traces and flags.

What a user expects of a command line (and what every other ``kvtier`` command does): a bad
input is refused with one line on stderr naming the line / field / flag, exit status 2, no
traceback. And the figures it prints are right: the LRU simulation (bench/trace/sim.py) is
the leaf-only LRU its docstring describes, checked against a hand count on tiny traces.

Each case runs ``kvtier bench trace`` as a real subprocess (the real kvtierd and engine
workers where the bench gets that far), with tiny traces and pools.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PY = sys.executable


def _bench(
    tmp: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    """``kvtier bench trace ARGS`` run in ``tmp`` (``env``: added to this environment)."""
    return subprocess.run(
        [PY, "-m", "kvtier.cli.main", "bench", "trace", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
        env={**os.environ, **(env or {})},
    )


def _fast(trace: Path, *more: str) -> list[str]:
    return ["--trace", str(trace), "--blocks", "4", "--engines", "1", "--speedup", "100000", *more]


def _refused(r: subprocess.CompletedProcess[str], *words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, err[-600:])
    assert "Traceback" not in err, err[-600:]
    assert len(err.splitlines()) == 1, err[-600:]
    for w in words:
        assert w in err, (w, err)


OK = '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}\n'

BAD_LINES = {
    "truncated_last_line": (OK + '{"timestamp": 1, "hash_ids": [1,', ":2", "JSON"),
    "missing_hash_ids": (OK + '{"timestamp": 1}\n', ":2", "hash_ids"),
    "negative_id": (OK + '{"timestamp": 1, "hash_ids": [1, -5]}\n', ":2", "hash_ids"),
    "huge_id": (OK + '{"timestamp": 1, "hash_ids": [18446744073709551616]}\n', ":2", "hash_ids"),
    "float_id": (OK + '{"timestamp": 1, "hash_ids": [1.5]}\n', ":2", "hash_ids"),
    "string_id": (OK + '{"timestamp": 1, "hash_ids": ["7"]}\n', ":2", "hash_ids"),
    "not_an_object": (OK + "[1, 2]\n", ":2", "hash_ids"),
    "string_timestamp": (OK + '{"timestamp": "soon", "hash_ids": [1]}\n', ":2", "timestamp"),
    "nan_timestamp": (OK + '{"timestamp": NaN, "hash_ids": [1]}\n', ":2", "timestamp"),
    "infinite_timestamp": (OK + '{"timestamp": 1e400, "hash_ids": [1]}\n', ":2", "timestamp"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_trace_line_is_refused_in_one_line_exit_2(tmp_path: Path, case: str) -> None:
    """A trace line that is not a Mooncake request (load_trace raises TraceError naming
    ``file:line`` and the field) reaches the user as that one line and exit 2, never a
    Python traceback (NaN / Infinity timestamps, which json accepts, are refused as a bad
    ``timestamp``)."""
    text, where, field = BAD_LINES[case]
    trace = tmp_path / "t.jsonl"
    trace.write_text(text)
    _refused(_bench(tmp_path, *_fast(trace)), where, field)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["missing", "directory", "corrupt_gzip", "truncated_gzip"])
def test_unreadable_trace_file_is_refused_in_one_line_exit_2(tmp_path: Path, case: str) -> None:
    """A ``--trace`` that does not exist, is a directory, or is a corrupt / truncated gzip
    file: one line naming the file, exit 2, no traceback."""
    trace = tmp_path / "t.jsonl.gz"
    if case == "directory":
        trace.mkdir()
    elif case == "corrupt_gzip":
        trace.write_bytes(b"this is not gzip at all\n")
    elif case == "truncated_gzip":
        trace.write_bytes(gzip.compress((OK * 50).encode())[:30])
    _refused(_bench(tmp_path, *_fast(trace)), trace.name)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["empty_file", "blank_lines", "limit_0"])
def test_trace_without_requests_is_refused_not_a_zero_division(tmp_path: Path, case: str) -> None:
    """A trace with no request (an empty file, only blank lines, or ``--limit 0``) has no
    hit rate to measure: one line saying so, exit 2, never a ZeroDivisionError after a
    replay of nothing."""
    trace = tmp_path / "t.jsonl"
    trace.write_text({"empty_file": "", "blank_lines": "\n   \n\n"}.get(case, OK))
    extra = ["--limit", "0"] if case == "limit_0" else []
    r = _bench(tmp_path, *_fast(trace, *extra))
    assert "ZeroDivisionError" not in r.stderr, r.stderr[-600:]
    _refused(r)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags",
    [
        ["--blocks", "abc"],
        ["--blocks", "100,x"],
        ["--blocks", "0"],
        ["--blocks", "-3"],
        ["--blocks", ","],
        ["--engines", "0"],
        ["--speedup", "-1"],
        ["--speedup", "nan"],
    ],
    ids=[
        "blocks_abc",
        "blocks_100_x",
        "blocks_0",
        "blocks_neg",
        "blocks_comma",
        "engines_0",
        "speedup_neg",
        "speedup_nan",
    ],
)
def test_bad_flag_is_a_usage_error_exit_2(tmp_path: Path, flags: list[str]) -> None:
    """A bad ``--blocks`` / ``--engines`` / ``--speedup`` (``nan`` included) is a usage
    error: one line naming the flag, exit 2, as argparse does for ``--engines abc``."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(OK)
    args = ["--trace", str(trace), "--blocks", "4", "--engines", "1", *flags]
    _refused(_bench(tmp_path, *args), flags[0])


@pytest.mark.timeout(90)
def test_unwritable_json_path_refused_before_the_replay(tmp_path: Path) -> None:
    """``--json`` under a regular file cannot be written: a one-line refusal naming
    ``--json``/the path, exit 2, before any replay (whose result would be lost)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(OK)
    _refused(_bench(tmp_path, *_fast(trace, "--json", str(trace / "out.json"))), "t.jsonl")


# Block 3 is inserted first as the child of 1, then (after its eviction) again as a chain's
# first block: the simulation keeps its stale parent and miscounts 1's resident children.
HAND_TRACES = [
    # capacity 1. R1 [3,4]: evict 4, keep 3. R2 [4]: miss; evict 3 (older leaf). R3 [3]: miss;
    # evict 4. R4 [2]: miss; evict 3 (older). R5 [3]: miss. Hits 0 / 6 blocks.
    ([[3, 4], [4], [3], [2], [3]], 1, 0.0),
    # capacity 1. R1 [1,3]: keep 1. R2 [3]: miss; evict 1. R3 [2,1]: miss; evict 3, then the
    # leaf 1, keeping 2. Hits 0 / 5 blocks.
    ([[1, 3], [3], [2, 1]], 1, 0.0),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chains,cap,want", HAND_TRACES, ids=["stale_parent_pins", "index_error"])
def test_lru_simulation_matches_hand_count(chains: list[list[int]], cap: int, want: float) -> None:
    """``lru_hit_rate`` is leaf-only LRU (sim.py's docstring): after each request the least
    recently used resident block without a resident child goes. Counted by hand above: 0.0,
    also when a block evicted comes back under another parent (or as a chain's head): it
    takes the parent it has then."""
    from kvtier.bench.trace.sim import lru_hit_rate, min_hit_rate

    assert lru_hit_rate(chains, cap) == pytest.approx(want)
    assert min_hit_rate(chains, cap) >= want


@pytest.mark.timeout(120)
def test_bench_on_hand_trace_prints_lru_of_the_hand_count(tmp_path: Path) -> None:
    """End to end: the hand trace above through ``kvtier bench trace --blocks 1 --engines 1
    --policy lru --json``: exit 0 and ``lru_hit_rate`` [0.0], every hit rate in [0, 1] and
    MIN >= LRU."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": i, "input_length": 512 * len(c), "output_length": 1, "hash_ids": c}
            )
            + "\n"
            for i, c in enumerate(HAND_TRACES[1][0])
        )
    )
    out = tmp_path / "r.json"
    args = ["--trace", str(trace), "--blocks", "1", "--engines", "1", "--speedup", "100000"]
    r = _bench(tmp_path, *args, "--policy", "lru", "--json", str(out))
    assert r.returncode == 0, r.stderr[-800:]
    res = json.loads(out.read_text())
    assert res["lru_hit_rate"] == [0.0]
    for k in ("hit_rate", "lru_hit_rate", "min_hit_rate"):
        assert all(0.0 <= x <= 1.0 for x in res[k]), res
    assert res["min_hit_rate"][0] >= res["lru_hit_rate"][0]


@pytest.mark.timeout(120)
def test_unusual_but_valid_trace_runs_and_figures_are_consistent(tmp_path: Path) -> None:
    """Out-of-order / missing timestamps, an empty ``hash_ids``, ``input_length`` that
    disagrees with the ids, a trace larger than the pool, and duplicated unsorted
    ``--blocks``: the bench runs, exit 0, one figure per size, rates in [0, 1], MIN >= LRU,
    0 mismatched bytes."""
    rows = [
        {"timestamp": 50, "input_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "hash_ids": [1, 2, 3, 4]},
        {"hash_ids": []},
        {"timestamp": 20, "input_length": 99999, "hash_ids": [1, 2, 5]},
    ] + [{"timestamp": 30 + i, "hash_ids": [1, 2, 100 + i]} for i in range(20)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    args = ["--trace", str(trace), "--blocks", "8,3,8", "--engines", "2", "--speedup", "100000"]
    r = _bench(tmp_path, *args, "--policy", "lru", "--json", str(out))
    assert r.returncode == 0, r.stderr[-800:]
    res = json.loads(out.read_text())
    assert res["sizes"] == [8, 3, 8] and res["requests"] == len(rows)
    assert res["mismatched_bytes"] == 0
    for k in ("hit_rate", "lru_hit_rate", "min_hit_rate"):
        assert len(res[k]) == 3 and all(0.0 <= x <= 1.0 for x in res[k]), res
    for lru, best in zip(res["lru_hit_rate"], res["min_hit_rate"], strict=True):
        assert best >= lru


@pytest.mark.timeout(120)
def test_repeated_id_in_one_request_refused_or_counted_alike(tmp_path: Path) -> None:
    """A request whose ``hash_ids`` repeat an id ([5, 6, 5, 7], three times), one engine,
    ``--policy lru``: the docs promise the kvtier column and the LRU simulated "over the
    same access sequence" are comparable (with one engine, the daemon's LRU serves what the
    simulation counts): either the line is refused (exit 2, one line naming the line and
    ``hash_ids``: a block names its whole prefix, so it never comes twice in one request)
    or both count the same hits."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(json.dumps({"timestamp": i, "hash_ids": [5, 6, 5, 7]}) + "\n" for i in range(3))
    )
    out = tmp_path / "r.json"
    args = ["--trace", str(trace), "--blocks", "2", "--engines", "1", "--speedup", "100000"]
    r = _bench(tmp_path, *args, "--policy", "lru", "--json", str(out))
    if r.returncode == 2:
        _refused(r, ":1", "hash_ids")
        return
    assert r.returncode == 0, r.stderr[-800:]
    res = json.loads(out.read_text())
    assert res["mismatched_bytes"] == 0
    assert res["hit_rate"] == res["lru_hit_rate"], res
