#!/usr/bin/env bash
# kvtier's GPU check: one script for one short session on a machine with an NVIDIA GPU.
#
# On a bare GPU machine with Python, PyTorch (CUDA build) and CuPy but no network, it installs
# kvtier and the few wheels it lacks from a folder prepared beforehand on a CPU machine
# (`make gpu-wheels`, which fills ./.whl), runs tests/cuda and bench/cuda_bench.py, and writes one
# JSON summary. Everything is bounded so that the whole run ends within 8 minutes.
#
#   bash bench/gpu_check.sh [SUMMARY_JSON]        (default: $OUT/gpu_check.json or ./gpu_check.json)
#
# Exit status: 0 when the tests pass and the bench meets its targets, or when there is no GPU
# (the summary then says so); 1 when a step could not run; 2 when tests failed or a target
# was missed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${KVTIER_WHEELS:-$ROOT/.whl}
SUMMARY=${1:-${OUT:-$ROOT}/gpu_check.json}
WORK=$(mktemp -d /tmp/kvtier-gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT  # the summary has what it needs by then
START=$(date +%s)
TEST_LIMIT_S=${TEST_LIMIT_S:-240}
BENCH_LIMIT_S=${BENCH_LIMIT_S:-240}

say() { echo "gpu-check: $*" >&2; }
summary() {  # summary STATUS REASON: the one JSON summary, from what the steps left in $WORK
    "$PY" - "$SUMMARY" "$1" "$2" "$WORK" "$START" <<'EOF'
import json, os, sys, time
path, status, reason, work, start = sys.argv[1:6]
def read(name):
    try:
        with open(os.path.join(work, name)) as f:
            return f.read()
    except OSError:
        return None
out = {"status": status, "reason": reason, "seconds": round(time.time() - int(start), 1)}
gpu = read("gpu.json")
out["gpu"] = json.loads(gpu) if gpu else None
tests = read("tests.txt")
if tests is not None:
    lines = [l for l in tests.splitlines() if l.strip()]
    out["tests_exit"] = int(read("tests.rc") or -1)
    out["tests_summary"] = lines[-1] if lines else ""
    out["tests_failures"] = [l for l in lines if l.startswith(("FAILED", "ERROR"))][:40]
bench = read("bench.json")
if bench:
    out["bench"] = json.loads(bench)
out["bench_exit"] = int(read("bench.rc")) if read("bench.rc") else None
with open(path, "w") as f:
    json.dump(out, f, indent=2)
print(json.dumps({k: out[k] for k in ("status", "reason", "seconds")}))
EOF
}

# 1. Is there a GPU that PyTorch can use?
if ! "$PY" - "$WORK/gpu.json" <<'EOF'
import json, sys
try:
    import torch
except ImportError as err:
    sys.exit(f"no torch: {err}")
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
p = torch.cuda.get_device_properties(0)
json.dump({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
           "capability": f"{p.major}.{p.minor}", "torch": torch.__version__,
           "cuda": torch.version.cuda, "devices": torch.cuda.device_count()},
          open(sys.argv[1], "w"))
EOF
then
    say "no GPU here: nothing to check"
    summary no_gpu "no CUDA device visible to torch"
    exit 0
fi
say "GPU: $(cat "$WORK/gpu.json")"

# 2. Install kvtier and what the machine lacks, from the prepared folder only (no network).
if ! "$PY" -c "import cupy" 2>/dev/null; then
    say "cupy is missing (the machine should have cupy-cuda13x); trying $WHEELS"
fi
if [ -d "$WHEELS" ]; then
    say "installing wheels from $WHEELS"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps "$WHEELS"/*.whl \
        >"$WORK/pip.txt" 2>&1 || { say "pip failed: $(tail -3 "$WORK/pip.txt")"; }
fi
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT" \
        >>"$WORK/pip.txt" 2>&1; then
    say "installing kvtier failed: $(tail -5 "$WORK/pip.txt")"
    summary error "pip install -e . failed (see pip output)"
    exit 1
fi
if ! "$PY" -c "import kvtier.daemon.service.server, kvtier.client.cuda_pool, zmq, msgspec, pydantic" \
        2>"$WORK/import.txt"; then
    say "kvtier does not import: $(tail -3 "$WORK/import.txt")"
    summary error "kvtier does not import: $(tail -1 "$WORK/import.txt")"
    exit 1
fi

# 3. The CUDA tests, bounded.
say "tests/cuda (limit ${TEST_LIMIT_S}s)"
timeout "$TEST_LIMIT_S" "$PY" -m pytest -q -p no:cacheprovider tests/cuda -x --timeout 120 \
    >"$WORK/tests.txt" 2>&1
echo $? >"$WORK/tests.rc"
tail -3 "$WORK/tests.txt" >&2

# 4. The GPU bench, bounded.
say "bench/cuda_bench.py (limit ${BENCH_LIMIT_S}s)"
timeout "$BENCH_LIMIT_S" "$PY" -m kvtier.bench.cuda_bench --json "$WORK/bench.json" \
    >"$WORK/bench.txt" 2>&1
echo $? >"$WORK/bench.rc"
tail -15 "$WORK/bench.txt" >&2

TRC=$(cat "$WORK/tests.rc"); BRC=$(cat "$WORK/bench.rc")
if [ "$TRC" = 0 ] && [ "$BRC" = 0 ]; then
    summary ok "tests passed, targets met"; exit 0
elif [ "$TRC" = 124 ] || [ "$BRC" = 124 ]; then
    summary error "a step ran past its limit (tests rc $TRC, bench rc $BRC)"; exit 1
else
    summary failed "tests rc $TRC, bench rc $BRC"; exit 2
fi
