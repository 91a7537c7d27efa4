"""`make gpu-check` (bench/gpu_check.sh) never reports ``ok`` without proof.

On this machine torch sees no GPU; the script must end with status ``no_gpu`` and a non-zero
exit. To reach its later steps without a GPU, a FAKE torch (it claims one CUDA device) and a FAKE
CuPy (numpy behind a CuPy-shaped module) are put on the path of the script's probes only: they
stand in for what cannot run here, a GPU. The CUDA tests themselves then run with the real CPU
torch, where every GPU test skips, and the script must say that no CUDA test passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"

FAKE_TORCH = '''
"""FAKE torch for tests/unit/test_gpu_check.py: claims one CUDA device; nothing runs on it."""
__version__ = "0.0-fake"
class version:
    cuda = "13.0-fake"
class _Props:
    name, total_memory, major, minor = "FAKE GPU (no device)", 1 << 34, 9, 0
class cuda:
    @staticmethod
    def is_available(): return True
    @staticmethod
    def device_count(): return 1
    @staticmethod
    def get_device_properties(i): return _Props()
'''

FAKE_CUPY_BROKEN_NVRTC = '''
"""FAKE CuPy for tests/unit/test_gpu_check.py: NVRTC cannot compile anything."""
__version__ = "0.0-fake"
class CompileException(Exception):
    pass
def RawKernel(src, name):
    raise CompileException("nvrtc: error: failed to open libnvrtc-builtins.so.13.0 (fake)")
'''

FAKE_CUPY_WORKING = '''
"""FAKE CuPy for tests/unit/test_gpu_check.py: numpy behind CuPy's names, no GPU involved."""
import numpy as _np
__version__ = "0.0-fake"
int32 = _np.int32
arange, zeros_like = _np.arange, _np.zeros_like
class RawKernel:
    def __init__(self, src, name): pass
    def __call__(self, grid, block, args):
        a, b, n = args
        b[:int(n)] = 2 * a[:int(n)]
class cuda:
    class nvrtc:
        @staticmethod
        def getVersion(): return (0, 0)
    class runtime:
        @staticmethod
        def runtimeGetVersion(): return 0
'''


def _run(
    tmp_path: Path, fakes: dict[str, str] | None = None, env: dict[str, str] | None = None
) -> tuple[int, dict[str, object], str]:
    python = sys.executable
    if fakes is not None:
        fake_dir = tmp_path / "fakes"
        for name, source in fakes.items():
            (fake_dir / name).mkdir(parents=True)
            (fake_dir / name / "__init__.py").write_text(textwrap.dedent(source))
        wrapper = tmp_path / "python-with-fakes"
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{fake_dir}" exec "{sys.executable}" "$@"\n')
        wrapper.chmod(0o755)
        python = str(wrapper)
    summary = tmp_path / "summary.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    full_env.update({"PYTHON": python, "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels")})
    full_env.update(env or {})
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(summary)],
        env=full_env,
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    return proc.returncode, json.loads(summary.read_text()), out


def _assert_not_ok(rc: int, summary: dict[str, object], out: str) -> None:
    assert rc != 0, out
    assert summary["status"] != "ok", summary
    assert '"status": "ok"' not in out, out


@pytest.mark.timeout(300)
def test_without_a_gpu_the_check_ends_no_gpu_and_never_ok(tmp_path: Path) -> None:
    rc, summary, out = _run(tmp_path)
    _assert_not_ok(rc, summary, out)
    assert rc == 3 and summary["status"] == "no_gpu", (rc, summary)
    assert "no CUDA device" in str(summary["reason"])


FAKE_TORCH_BROKEN = '''
"""FAKE torch for tests/unit/test_gpu_check.py: sees a device, then fails to describe it."""
__version__ = "0.0-fake"
class cuda:
    @staticmethod
    def is_available(): return True
    @staticmethod
    def get_device_properties(i): raise RuntimeError("CUDA driver error: unknown error (fake)")
'''


@pytest.mark.timeout(300)
def test_a_probe_that_fails_on_a_gpu_is_an_error_not_no_gpu(tmp_path: Path) -> None:
    """A torch that sees a device but fails to use it is a broken install, not a machine
    without a GPU: status error, naming what failed."""
    rc, summary, out = _run(tmp_path, {"torch": FAKE_TORCH_BROKEN})
    _assert_not_ok(rc, summary, out)
    assert rc == 1 and summary["status"] == "error", (rc, summary)
    assert "probe failed" in str(summary["reason"]) and "unknown error" in out


@pytest.mark.timeout(300)
def test_a_gpu_without_cupy_is_an_error_naming_cupy(tmp_path: Path) -> None:
    rc, summary, out = _run(tmp_path, {"torch": FAKE_TORCH})
    _assert_not_ok(rc, summary, out)
    assert summary["status"] == "error" and "CuPy does not import" in str(summary["reason"])
    assert summary["probe"] is not None  # the fake GPU was seen: the failure is CuPy's


@pytest.mark.timeout(300)
def test_nvrtc_that_cannot_compile_is_an_error_naming_nvrtc(tmp_path: Path) -> None:
    rc, summary, out = _run(tmp_path, {"torch": FAKE_TORCH, "cupy": FAKE_CUPY_BROKEN_NVRTC})
    _assert_not_ok(rc, summary, out)
    assert summary["status"] == "error"
    assert "NVRTC could not compile" in str(summary["reason"]), summary


@pytest.mark.timeout(300)
def test_all_cuda_tests_skipped_is_a_failure_not_ok(tmp_path: Path) -> None:
    # The CUDA tests run in this venv with the real CPU torch: each GPU test skips.
    venv = Path(sys.executable).parent.parent
    rc, summary, out = _run(
        tmp_path,
        {"torch": FAKE_TORCH, "cupy": FAKE_CUPY_WORKING},
        {"GPU_CHECK_SHM_MIN_GIB": "0", "GPU_CHECK_VENV": str(venv)},
    )
    _assert_not_ok(rc, summary, out)
    assert summary["status"] == "failed", summary
    assert "no CUDA test passed" in str(summary["reason"]), summary
    tests = summary["tests"]
    assert isinstance(tests, dict) and tests["passed"] == 0 and tests["skipped"] > 0, tests


@pytest.mark.timeout(600)
def test_the_install_step_makes_a_venv_that_sees_a_venv_pythons_packages(tmp_path: Path) -> None:
    """The machine's Python here is this test's venv, as on a GPU machine whose python3 is a
    venv holding torch and CuPy: the check's own venv must still see them (through its .pth),
    build kvtier from this tree into itself, run the CUDA tests with that kvtier, and run the
    bench even though no CUDA test passed. Everything the pins name is in this venv already,
    so the list of wheels to install is empty."""
    reqs, wheels = tmp_path / "requirements.txt", tmp_path / "wheels"
    reqs.write_text("# nothing: this venv has every pinned package\n")
    wheels.mkdir()
    rc, summary, out = _run(
        tmp_path,
        {"torch": FAKE_TORCH, "cupy": FAKE_CUPY_WORKING},
        {
            "GPU_CHECK_SHM_MIN_GIB": "0",
            "GPU_CHECK_WHEELS": str(wheels),
            "GPU_CHECK_REQUIREMENTS": str(reqs),
        },
    )
    _assert_not_ok(rc, summary, out)
    assert summary["status"] == "failed" and "no CUDA test passed" in str(summary["reason"])
    steps = summary["steps"]
    assert isinstance(steps, dict) and steps["install"]["rc"] == 0, steps
    installed = "\n".join(steps["install"]["tail"])
    built = [line for line in steps["install"]["tail"] if "kvtier built here" in line]
    assert built and "/kvtier-gpu-check." in built[0] and "/dist/kvtier-" in built[0], installed
    assert "/venv/lib/" in installed and "kvtier/daemon/__init__.py" in installed, installed
    assert "bench" in steps, steps  # it ran after the tests failed
    with tarfile.open(tmp_path / "summary_logs.tar.gz") as logs:
        names = set(logs.getnames())
    assert {"install.txt", "tests.txt", "tests.xml", "bench.txt"} <= names, names


def test_pinned_gpu_wheels_cover_what_kvtier_needs() -> None:
    """Every runtime dependency of kvtier except torch and numpy (the GPU machine has them) and
    the test tools the check runs are pinned in bench/gpu-requirements.txt, so the check never
    needs the network."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(req: str) -> str:
        for sep in "<>=[; ":
            req = req.split(sep)[0]
        return req.strip().lower().replace("_", "-")

    needed = {name(d) for d in project["dependencies"]} - {"torch", "numpy"}
    needed |= {"pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "setuptools"}
    pins = {}
    for line in (ROOT / "bench" / "gpu-requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            assert "==" in line, f"not pinned: {line!r}"
            pins[name(line)] = line
    missing = needed - set(pins)
    assert not missing, f"not in bench/gpu-requirements.txt: {sorted(missing)}"
