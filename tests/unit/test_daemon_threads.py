"""kvtierd's process starts no BLAS thread pool: the daemon does no floating-point linear
algebra, and numpy's OpenBLAS starting a thread per core as it loads cost ~90 ms of CPU
before the daemon was healthy. The setting must come before anything imports numpy, so it
is checked in a fresh interpreter that imports kvtierd's entry point the way ``kvtierd``
does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import kvtier.daemon.__main__
from kvtier.daemon.service import server  # imports the wire format, hence numpy
import ctypes, glob, os, numpy
libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__) + ".libs", "*openblas*"))
fn = None
for path in libs:
    lib = ctypes.CDLL(path)
    for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                 "openblas_get_num_threads"):
        fn = getattr(lib, name, None) or fn
print(fn() if fn is not None else "none")
"""


def test_kvtierd_entry_point_keeps_openblas_to_one_thread():
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    if out == "none":
        pytest.skip("this numpy does not bundle an OpenBLAS with a thread-count query")
    assert out == "1", f"OpenBLAS runs {out} threads in kvtierd's process"
