#!/usr/bin/env bash
# kvtier's GPU check: one bounded script for a machine with an NVIDIA GPU, that cannot report
# `ok` without proof.
#
# For a bare GPU machine with Python 3.12, torch (CUDA build) and CuPy but no network: it makes a
# venv that sees the machine's torch and CuPy (--system-site-packages), installs the pinned wheels
# of bench/gpu-requirements.txt from ./.whl only (`make gpu-wheels` fills it on a CPU machine) and
# kvtier itself, then runs, in order:
#
#   1. probe     torch sees a CUDA device (else status no_gpu)
#   2. cupy      CuPy imports and NVRTC compiles and runs a kernel (pip's NVRTC found for it)
#   3. shm       /dev/shm has room for the host pools the tests and the bench create
#   4. install   the venv, the wheels, kvtier
#   5. tests     tests/cuda: at least one CUDA test must pass and none may fail or error
#   6. bench     bench/cuda_bench.py: both copy modes' bandwidth against cudaMemcpyAsync, and the
#                layer-wise overlap alone and beside a second process computing on the GPU
#
# Every step runs under `timeout -k` in its own process group, and whatever a step started that
# outlived it (kvtierd, engine children) is killed by the marker in its environment. The whole
# run is bounded by GPU_CHECK_LIMIT_S (default 330 s: with the last step's kill grace and the
# summary, within 6 minutes; the tests' and the bench's own parts by GPU_CHECK_TESTS_S,
# default 180, and GPU_CHECK_BENCH_S, default 210). One JSON summary is
# written, and beside it every step's whole output (GPU_CHECK_LOGS; empty: none).
# GPU_CHECK_REQUIREMENTS names another list of pinned wheels than bench/gpu-requirements.txt.
# GPU_CHECK_VENV names a venv prepared by hand, to use instead of making one.
#
#   bash bench/gpu_check.sh [SUMMARY_JSON]        (default: $OUT/gpu_check.json or ./gpu_check.json)
#
# Exit status: 0 only when every step ran, the CUDA tests passed and the bench met its targets
# (status "ok"); 3 when there is no GPU (status "no_gpu"); 1 when a step could not run or ran past
# its limit (status "error"); 2 when tests failed or a target was missed (status "failed").
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
SUMMARY=${1:-${OUT:-$ROOT}/gpu_check.json}
LOGS=${GPU_CHECK_LOGS-${SUMMARY%.json}_logs.tar.gz}  # every step's output; empty: none
[ -n "$LOGS" ] && LOGS=$(realpath -m "$LOGS")
WORK=$(mktemp -d /tmp/kvtier-gpu-check.XXXXXX)
START=$(date +%s)
TOTAL_LIMIT_S=${GPU_CHECK_LIMIT_S:-330}  # 6 minutes less the kill grace and the summary
END_RESERVE_S=15  # kept after the last step: its kill grace (10 s), the summary, the logs
SHM_MIN_GIB=${GPU_CHECK_SHM_MIN_GIB:-12}
MARK="GPU_CHECK_RUN_MARK=$WORK"  # not KVTIER_*: kvtierd refuses unknown KVTIER_ variables

say() { echo "gpu-check: $*" >&2; }

reap() {  # kill every process a step left behind (they carry the marker in their environment)
    local p
    for p in /proc/[0-9]*; do
        if grep -qzxF -- "$MARK" "$p/environ" 2>/dev/null; then
            kill -KILL "${p#/proc/}" 2>/dev/null
        fi
    done
}
trap 'reap; rm -rf "$WORK"' EXIT

left() { echo $((TOTAL_LIMIT_S - ($(date +%s) - START))); }

step() {  # step NAME LIMIT_S CMD...: run CMD bounded, in its own process group; rc in $WORK/NAME.rc
    local name=$1 limit=$2 rest
    shift 2
    rest=$(($(left) - END_RESERVE_S))
    [ "$rest" -lt "$limit" ] && limit=$rest
    if [ "$limit" -le 5 ]; then
        echo 124 >"$WORK/$name.rc"
        say "$name: no time left of the ${TOTAL_LIMIT_S}s limit"
        return 124
    fi
    env "$MARK" setsid -w timeout -k 10 "$limit" "$@" >"$WORK/$name.txt" 2>&1
    local rc=$?
    echo "$rc" >"$WORK/$name.rc"
    reap
    return "$rc"
}

summary() {  # summary STATUS REASON: the one JSON summary, from what the steps left in $WORK
    "$PY" - "$SUMMARY" "$1" "$2" "$WORK" "$START" <<'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET
path, status, reason, work, start = sys.argv[1:6]
def read(name):
    try:
        with open(os.path.join(work, name)) as f:
            return f.read()
    except OSError:
        return None
def tail(name, n=6):
    text = read(name)
    return text.strip().splitlines()[-n:] if text else []
out = {"status": status, "reason": reason, "seconds": round(time.time() - int(start), 1)}
for name in ("probe", "cupy", "shm"):
    text = read(name + ".json")
    out[name] = json.loads(text) if text else None
steps = {}
for name in ("probe", "cupy", "shm", "install", "tests", "bench"):
    rc = read(name + ".rc")
    if rc is not None:
        steps[name] = {"rc": int(rc), "tail": tail(name + ".txt")}
out["steps"] = steps
junit = os.path.join(work, "tests.xml")
try:
    cases = list(ET.parse(junit).getroot().iter("testcase")) if os.path.exists(junit) else None
except (OSError, ET.ParseError) as err:  # pytest was stopped while writing it
    cases, out["tests"] = None, {"unreadable": str(err)}
if cases is not None:
    def kind(case):
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                return child.tag
        return "passed"
    kinds = [kind(c) for c in cases]
    out["tests"] = {k: kinds.count(k) for k in ("passed", "failure", "error", "skipped")}
    out["tests"]["failed_names"] = [f"{c.get('classname')}::{c.get('name')}"
                                    for c, k in zip(cases, kinds) if k in ("failure", "error")][:40]
bench = read("bench.json")
try:
    out["bench"] = json.loads(bench) if bench else None
except ValueError as err:  # the bench was stopped while writing it
    out["bench"] = {"status": "unreadable", "error": str(err)}
with open(path, "w") as f:
    json.dump(out, f, indent=2)
print(json.dumps({k: out[k] for k in ("status", "reason", "seconds")}))
EOF
}

finish() {  # finish STATUS REASON EXIT
    say "$1: $2"
    summary "$1" "$2"
    if [ -n "$LOGS" ]; then  # every step's whole output, beside the summary
        (cd "$WORK" && tar -czf "$LOGS" -- $(ls -- *.txt *.xml *.json 2>/dev/null)) 2>/dev/null
    fi
    exit "$3"
}

# 1. Is there a GPU that torch can use?
step probe 60 "$PY" - "$WORK/probe.json" <<'EOF'
import json, sys
try:
    import torch
except ImportError as err:
    sys.exit(f"torch does not import: {err}")
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA device")
    sys.exit(3)
p = torch.cuda.get_device_properties(0)
json.dump({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
           "capability": f"{p.major}.{p.minor}", "torch": torch.__version__,
           "cuda": torch.version.cuda, "devices": torch.cuda.device_count()},
          open(sys.argv[1], "w"))
EOF
case $? in
    0) say "GPU: $(cat "$WORK/probe.json")" ;;
    124|137) finish error "the GPU probe ran past its limit" 1 ;;
    3) finish no_gpu "no GPU: $(tail -1 "$WORK/probe.txt")" 3 ;;
    *) finish error "the GPU probe failed: $(tail -1 "$WORK/probe.txt")" 1 ;;
esac

# 2. CuPy, and NVRTC able to compile and run a kernel. pip's NVRTC (nvidia-cuda-nvrtc) lives
# under site-packages/nvidia/*/lib, where CuPy may not look: put those folders on the path.
NVLIB=$("$PY" - <<'EOF' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
dirs = {os.path.dirname(p) for r in roots if os.path.isdir(r)
        for p in glob.glob(os.path.join(r, "nvidia", "**", "libnvrtc*.so*"), recursive=True)}
print(":".join(sorted(dirs)))
EOF
)
[ -n "$NVLIB" ] && export LD_LIBRARY_PATH="$NVLIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
step cupy 90 "$PY" - "$WORK/cupy.json" <<'EOF'
import json, sys
try:
    import cupy
except ImportError as err:
    sys.exit(f"CuPy does not import: {err}")
src = r'extern "C" __global__ void twice(const int* a, int* b, int n) {' \
      r' int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = 2 * a[i]; }'
try:
    kernel = cupy.RawKernel(src, "twice")
    a = cupy.arange(1000, dtype=cupy.int32)
    b = cupy.zeros_like(a)
    kernel((4,), (256,), (a, b, cupy.int32(1000)))
    ok = bool((b == 2 * a).all())
except Exception as err:  # any failure here is the step's verdict, named
    sys.exit(f"NVRTC could not compile or run a kernel: {type(err).__name__}: {err}")
if not ok:
    sys.exit("the NVRTC-compiled kernel ran but computed wrong values")
json.dump({"cupy": cupy.__version__, "nvrtc": list(cupy.cuda.nvrtc.getVersion()),
           "runtime": cupy.cuda.runtime.runtimeGetVersion()}, open(sys.argv[1], "w"))
EOF
case $? in
    0) say "CuPy and NVRTC: $(cat "$WORK/cupy.json")" ;;
    124|137) finish error "the CuPy/NVRTC check ran past its limit" 1 ;;
    *) finish error "$(tail -1 "$WORK/cupy.txt")" 1 ;;
esac

# 3. Room in /dev/shm for the host pools (the bench alone maps an 8 GiB pool).
step shm 10 "$PY" - "$WORK/shm.json" "$SHM_MIN_GIB" <<'EOF'
import json, os, sys
st = os.statvfs("/dev/shm")
free = st.f_bavail * st.f_frsize / 2**30
json.dump({"free_gib": round(free, 1), "need_gib": float(sys.argv[2])}, open(sys.argv[1], "w"))
if free < float(sys.argv[2]):
    sys.exit(f"/dev/shm has {free:.1f} GiB free, the check needs {sys.argv[2]} GiB")
EOF
[ "$(cat "$WORK/shm.rc")" = 0 ] || finish error "$(tail -1 "$WORK/shm.txt")" 1

# 4. A venv over the machine's torch and CuPy; the pinned wheels; kvtier.
# The machine's python3 may itself be a venv (its torch and CuPy in that venv's site-packages),
# which a --system-site-packages venv made from it would not see, and its pip may lack ensurepip:
# so the venv is made without pip, a .pth file names the machine's site folders (after the venv's
# own, so the pinned wheels come first), and the machine's pip installs into the venv's folder.
# kvtier is built from this tree with the pinned setuptools; where the machine cannot compile C
# for Python (no Python.h), a kvtier wheel built for this Python on another machine and left in
# .whl/ is used instead, and the log says so.
VENV=${GPU_CHECK_VENV:-$WORK/venv}
install() {
    set -e
    local check="import kvtier.daemon.service.server, kvtier.kernels.cuda_copy, zmq, msgspec, pydantic, pytest, pytest_asyncio, torch"
    if [ -n "${GPU_CHECK_VENV:-}" ]; then  # a venv prepared by hand: use it as it is
        "$VENV/bin/python" -c "$check"
        return
    fi
    "$PY" -m venv --without-pip --system-site-packages "$VENV"
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        >"$site/zz_machine_site.pth"
    echo "machine site folders: $(tr '\n' ' ' <"$site/zz_machine_site.pth")"
    if [ ! -d "$WHEELS" ]; then
        echo "no $WHEELS (make gpu-wheels fills it)"
        return 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target "$site" \
        -r "$REQUIREMENTS"
    local whl=""
    if PYTHONPATH="$site" "$PY" -m pip wheel -q --no-index --no-deps --no-build-isolation \
        -w "$WORK/dist" "$ROOT"; then
        whl=$(ls "$WORK"/dist/kvtier-*.whl)
        echo "kvtier built here: $whl"
    else
        whl=$(ls "$WHEELS"/kvtier-*-cp"$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"-*.whl 2>/dev/null | head -1)
        [ -n "$whl" ] || { echo "kvtier does not build here and .whl/ has no kvtier wheel for this Python"; return 1; }
        local built_from here
        built_from=$(cat "$WHEELS/kvtier-source.sha256" 2>/dev/null || echo none)
        here=$(bash "$ROOT/bench/source_digest.sh")
        if [ "$built_from" != "$here" ]; then
            echo "kvtier does not build here, and $whl was built from other sources ($built_from, this tree $here): make gpu-wheels again"
            return 1
        fi
        echo "kvtier does not build here: using the prebuilt $whl, built from these sources ($here)"
    fi
    "$PY" -m pip install -q --no-index --no-deps --target "$site" "$whl"
    "$VENV/bin/python" -c "$check"
    "$VENV/bin/python" -c 'import kvtier.daemon, torch, pytest; print("kvtier", kvtier.daemon.__file__, "torch", torch.__version__, "pytest", pytest.__version__)'
}
export -f install
REQUIREMENTS=${GPU_CHECK_REQUIREMENTS:-$ROOT/bench/gpu-requirements.txt}
export VENV WHEELS ROOT PY WORK REQUIREMENTS
step install 150 bash -c install </dev/null
case $(cat "$WORK/install.rc") in
    0) say "installed into $VENV" ;;
    124|137) finish error "installing ran past its limit" 1 ;;
    *) finish error "installing failed: $(tail -1 "$WORK/install.txt")" 1 ;;
esac

# 5. The CUDA tests. Passing means: some CUDA test passed, none failed or errored. The machine's
# own pytest plugins are not loaded (they may not match the pinned pytest); warnings are shown,
# not turned into errors, since the machine's torch and CuPy may warn about their own versions.
say "tests/cuda"
step tests "${GPU_CHECK_TESTS_S:-180}" env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$VENV/bin/python" -m pytest \
    -p no:cacheprovider -p pytest_asyncio.plugin -p pytest_timeout -W default \
    tests/cuda -m cuda -rfEs -v --durations=15 --timeout 120 --junitxml="$WORK/tests.xml" </dev/null
TRC=$(cat "$WORK/tests.rc")
tail -3 "$WORK/tests.txt" >&2
PASSED=$("$PY" - "$WORK/tests.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    print(0)
    sys.exit()
print(sum(1 for c in cases if not any(ch.tag in ("failure", "error", "skipped") for ch in c)))
EOF
)
TESTS_VERDICT=""
case $TRC in
    124|137) TESTS_VERDICT="error:tests/cuda ran past its limit" ;;
    0) [ "$PASSED" -gt 0 ] || TESTS_VERDICT="failed:no CUDA test passed (all skipped)" ;;
    *) TESTS_VERDICT="failed:tests/cuda failed (rc $TRC, $PASSED passed)" ;;
esac

# 6. The GPU bench: run even after a test failed, for its figures; the verdict stays the tests'.
say "bench/cuda_bench.py"
BENCH_S=${GPU_CHECK_BENCH_S:-210}
[ "$(($(left) - END_RESERVE_S))" -lt "$BENCH_S" ] && BENCH_S=$(($(left) - END_RESERVE_S))
step bench "$BENCH_S" "$VENV/bin/python" -m kvtier.bench.cuda_bench --json "$WORK/bench.json" \
    --budget-s $((BENCH_S * 3 / 5)) </dev/null
BRC=$(cat "$WORK/bench.rc")
tail -25 "$WORK/bench.txt" >&2
case $TESTS_VERDICT in
    error:*) finish error "${TESTS_VERDICT#error:}" 1 ;;
    failed:*) finish failed "${TESTS_VERDICT#failed:}" 2 ;;
esac
case $BRC in
    0) "$PY" - "$WORK/bench.json" <<'EOF' 2>/dev/null || finish failed "the bench wrote no figures" 2
import json, sys
r = json.load(open(sys.argv[1]))
bw = r.get("bandwidth") or {}
need = ("load_over_baseline", "store_over_baseline",
        "engine_load_over_baseline", "engine_store_over_baseline")
sys.exit(0 if r.get("status") == "measured" and all(k in bw for k in need) else 1)
EOF
       finish ok "$PASSED CUDA tests passed, bench targets met" 0 ;;
    124|137) finish error "the bench ran past its limit" 1 ;;
    *) finish failed "the bench missed a target or failed (rc $BRC)" 2 ;;
esac
