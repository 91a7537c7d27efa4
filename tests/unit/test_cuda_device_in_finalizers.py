"""Which GPU a thread has current after a CUDA block is freed in it, checked without a GPU.

``_cuda_free`` is a ``weakref.finalize`` callback: it runs in whatever thread drops the last
reference (or runs the garbage collector), not in one that owns the block's GPU. Were the
block's GPU left current there, a thread of an engine working on another GPU would find its
current device switched under it: torch (``current_device``,
``torch.empty(device="cuda")``), CuPy and raw runtime calls go to the other GPU from then on.

CuPy is replaced by a stand-in whose runtime keeps the current device per thread, as
``cudaGetDevice``/``cudaSetDevice`` do, and whose driver tells whether a thread has a current
context (``cuCtxGetCurrent``), so a fix can restore the thread's device without selecting
GPU 0 on a thread that never chose one.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier.ipc import cuda_alloc


class _Runtime:
    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self) -> None:
        self._current = threading.local()
        self.freed: list[int] = []

    def getDevice(self) -> int:
        return getattr(self._current, "device", 0)  # cudaGetDevice on a fresh thread: 0

    def ctxGetCurrent(self) -> int:
        """``cuCtxGetCurrent``: 0 on a thread that never made a device current."""
        return 0x1000 + self._current.device if hasattr(self._current, "device") else 0

    def setDevice(self, device: int) -> None:
        self._current.device = device

    def malloc(self, nbytes: int) -> int:
        return 0x7F0000000000

    def free(self, ptr: int) -> None:
        self.freed.append(ptr)


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> _Runtime:
    rt = _Runtime()
    cupy = SimpleNamespace(
        cuda=SimpleNamespace(runtime=rt, driver=SimpleNamespace(ctxGetCurrent=rt.ctxGetCurrent))
    )
    monkeypatch.setattr(cuda_alloc, "cupy_module", lambda: cupy)
    return rt


def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # reported in the test's thread
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    if err:
        raise err[0]
    return out[0]


def test_a_block_finalized_in_another_gpus_thread_leaves_that_threads_gpu_current(runtime):
    """An engine thread works on GPU 2; the garbage collector, running in it, finalizes a
    block of GPU 1. After the free the thread's current device must still be GPU 2."""

    def engine_thread() -> int:
        runtime.setDevice(2)  # this thread's engine chose GPU 2
        cuda_alloc._cuda_free(0x7F0000000000, 1)  # a finalizer of a GPU 1 block runs here
        return runtime.getDevice()

    current = _in_thread(engine_thread)
    assert runtime.freed == [0x7F0000000000]
    assert current == 2, f"freeing a GPU 1 block left GPU {current} current in a GPU 2 thread"
