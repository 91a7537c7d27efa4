"""What the engine side does with CUDA devices, checked without a GPU.

kvtier's rule (docs/gpu.md, ``kvtier.ipc.cuda_backend``, ``kvtier.kernels.cuda_dma``): a GPU is
made current with ``cudaSetDevice`` and left current, never with CuPy's ``Device`` context
manager, whose exit switches back to the device current before it, which is device 0 on a
thread that never chose one; since CUDA 12 ``cudaSetDevice`` creates the primary context of
that device, so an engine on ``cuda:1`` would hold a context (hundreds of MiB) on GPU 0.

CuPy is replaced by a stand-in whose ``Device`` behaves exactly as CuPy's does
(``cupy/cuda/device.pyx``: ``__enter__`` pushes ``runtime.getDevice()`` and sets the device,
``__exit__`` calls ``runtime.setDevice`` with what it pushed) and whose runtime records every
``setDevice``. A fresh thread's current device is 0, as ``cudaGetDevice`` reports it.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kvtier.ipc import cuda_alloc


class _Runtime:
    """``cupy.cuda.runtime``: the device calls, per thread, recorded."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self) -> None:
        self._current = threading.local()
        self.set_devices: list[int] = []
        self.freed: list[int] = []

    def getDevice(self) -> int:
        return getattr(self._current, "device", 0)  # cudaGetDevice on a fresh thread: 0

    def setDevice(self, device: int) -> None:
        self.set_devices.append(device)
        self._current.device = device

    def ctxGetCurrent(self) -> int:
        """``cuCtxGetCurrent`` (CuPy's driver module): 0 on a thread that never set one."""
        return 0x1000 + self._current.device if hasattr(self._current, "device") else 0

    def malloc(self, nbytes: int) -> int:
        return 0x7F0000000000

    def free(self, ptr: int) -> None:
        self.freed.append(ptr)


def _fake_cupy() -> tuple[Any, _Runtime]:
    runtime = _Runtime()
    stack: list[int] = []

    class Device:  # CuPy's semantics (cupy/cuda/device.pyx, Device.__enter__ / __exit__)
        def __init__(self, device: int) -> None:
            self.id = device

        def __enter__(self) -> Device:
            prev = runtime.getDevice()
            stack.append(prev)
            if self.id != prev:
                runtime.setDevice(self.id)
            return self

        def __exit__(self, *exc: object) -> None:
            runtime.setDevice(stack.pop())

    driver = SimpleNamespace(ctxGetCurrent=runtime.ctxGetCurrent)
    cupy = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, driver=driver, Device=Device))
    return cupy, runtime


def _in_fresh_thread(fn: Any) -> None:
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # reported in the test's thread
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    if err:
        raise err[0]


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> _Runtime:
    cupy, runtime = _fake_cupy()
    monkeypatch.setattr(cuda_alloc, "cupy_module", lambda: cupy)
    monkeypatch.setattr(cuda_alloc, "require_cuda", lambda what: None)
    monkeypatch.setattr(cuda_alloc, "cuda_error_types", lambda: (runtime.CUDARuntimeError,))
    # the tensor over the allocation needs a GPU; what matters here is the device selection
    monkeypatch.setattr(
        cuda_alloc,
        "device_tensor",
        lambda ptr, nbytes, device, owner=None: SimpleNamespace(owner=owner, ptr=ptr),
    )
    return runtime


def test_a_cudamalloc_kv_pool_on_a_second_gpu_never_makes_gpu_0_current(fake_cupy) -> None:
    """``CudaKVPool(..., allocator="cudamalloc")`` on ``cuda:1`` (``empty_ipc_capable``) must
    select GPU 1 only: selecting GPU 0 creates a context there."""
    made: list[Any] = []
    _in_fresh_thread(lambda: made.append(cuda_alloc.empty_ipc_capable(4096, 1)))
    assert 1 in fake_cupy.set_devices
    assert 0 not in fake_cupy.set_devices, (
        f"setDevice calls {fake_cupy.set_devices}: the allocation on cuda:1 made GPU 0 current "
        "(cupy.cuda.Device's exit), which creates a CUDA context on GPU 0"
    )


def test_freeing_a_cudamalloc_block_of_a_second_gpu_never_makes_gpu_0_current(fake_cupy) -> None:
    """The block's finalizer (``_cuda_free``) runs in whatever thread drops the last tensor;
    freeing memory of ``cuda:1`` there must not select GPU 0."""
    _in_fresh_thread(lambda: cuda_alloc._cuda_free(0x7F0000000000, 1))
    assert fake_cupy.freed == [0x7F0000000000]
    assert 0 not in fake_cupy.set_devices, (
        f"setDevice calls {fake_cupy.set_devices}: freeing cuda:1 memory made GPU 0 current"
    )


def test_a_block_freed_in_a_thread_working_on_another_gpu_leaves_that_gpu_current(
    fake_cupy,
) -> None:
    """The finalizer may run in an engine thread working on GPU 2 (the garbage collector
    runs where it runs): after freeing a block of GPU 1 there, GPU 2 must be current again,
    or that thread's later torch, CuPy and runtime calls would go to GPU 1."""
    current: list[int] = []

    def engine_thread() -> None:
        fake_cupy.setDevice(2)  # this thread's engine chose GPU 2
        cuda_alloc._cuda_free(0x7F0000000000, 1)
        current.append(fake_cupy.getDevice())

    _in_fresh_thread(engine_thread)
    assert fake_cupy.freed == [0x7F0000000000]
    assert current == [2], f"freeing a GPU 1 block left GPU {current} current in a GPU 2 thread"
