"""On a CPU with AMX, the vLLM connector asks Linux for the process's AMX tile state, which
vLLM's CPU attention uses over cached context without asking: a fresh engine whose first
request is a kvtier hit would otherwise die of SIGILL (``test_vllm_kv_events.py`` restarts
such an engine). Each check runs in a fresh process: the permission, once granted, stays
for the process's life."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="AMX and arch_prctl's tile permission are x86-64's"
)

ARCH_GET_XCOMP_PERM = 0x1022
XFEATURE_XTILEDATA = 18

PROBE = f"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def granted():
    mask = ctypes.c_uint64(0)
    if libc.syscall(158, {ARCH_GET_XCOMP_PERM}, ctypes.byref(mask)) != 0:  # arch_prctl
        raise OSError(ctypes.get_errno(), "arch_prctl")
    return bool(mask.value >> {XFEATURE_XTILEDATA} & 1)
before = granted()
if sys.argv[1] == "connector":
    from kvtier.client.adapters.vllm.connector import allow_amx
    print(before, allow_amx(), granted())
else:
    print(before, granted())
"""


def _probe(what: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, what], check=True, capture_output=True, text=True, timeout=120
    )
    return out.stdout.split()


def test_the_connector_asks_for_the_amx_tile_state_where_the_cpu_has_amx() -> None:
    has_amx = torch.cpu._is_amx_tile_supported()
    before, asked, after = _probe("connector")
    assert before == "False"  # nothing in a fresh process has asked yet
    assert asked == str(has_amx)
    assert after == str(has_amx)  # granted exactly where the CPU has AMX


def test_a_fresh_process_has_no_amx_tile_state_until_it_asks() -> None:
    """The probe itself: without the call the state stays refused (what vLLM's kernel met)."""
    assert _probe("bare") == ["False", "False"]
