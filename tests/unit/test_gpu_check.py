"""``bench/gpu_check.sh`` on a machine without a GPU: a clean "no GPU" exit and its summary.

The script's GPU steps can only run on a GPU machine (docs/gpu.md); here the test checks the
part that decides, so a lent GPU session never starts with a script that fails on its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_gpu_check_exits_cleanly_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the whole check")
    summary = tmp_path / "gpu_check.json"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(summary)],
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                               "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "no GPU here" in proc.stderr
    out = json.loads(summary.read_text())
    assert out["status"] == "no_gpu" and out["gpu"] is None
    assert "CUDA" in out["reason"]


def test_gpu_wheel_list_covers_what_kvtier_imports() -> None:
    """Every runtime dependency of kvtier except torch/numpy (the GPU machine has them) is in
    the Makefile's GPU wheel list, so the check never needs the network."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in deps}
    make = (ROOT / "Makefile").read_text()
    block = make[make.index("GPU_WHEELS :="):make.index("gpu-wheels:")]
    listed = set(block.replace("\\", " ").split()[2:])
    missing = names - {"torch", "numpy"} - listed
    assert not missing, f"not in GPU_WHEELS: {sorted(missing)}"
