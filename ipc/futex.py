"""Futex waits and wake-ups on a 32-bit word of shared memory (Linux).

The completion block (:mod:`kvtier.ipc.completion`) uses them so an engine waiting for a
layer sleeps in the kernel until the daemon announces progress, instead of polling the block
on a timer: it wakes within microseconds of the announcement and spends no CPU meanwhile
(which matters when engines and the daemon share few cores). The futexes are shared ones
(no ``FUTEX_PRIVATE_FLAG``): the waiter and the waker are different processes mapping the
same memfd; a read-only mapping may wait.

Both calls go through libc's ``syscall`` with ctypes. A wait releases the GIL while it
sleeps; a wake keeps it (it never blocks and takes about a microsecond), so a copy thread
announcing a layer does not hand the GIL to the event loop and wait to get it back. Where
the system call is unknown (:data:`AVAILABLE` false) callers poll instead.
"""

from __future__ import annotations

import ctypes
import errno
import platform

__all__ = ["AVAILABLE", "wait", "wake"]

_SYS_FUTEX = {
    "x86_64": 202,
    "amd64": 202,
    "aarch64": 98,
    "arm64": 98,
    "ppc64le": 221,
    "s390x": 238,
    "riscv64": 98,
}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load(lib: type[ctypes.CDLL]) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``syscall`` through ``lib`` (CDLL releases the GIL around a call, PyDLL not)."""
    if _SYS_FUTEX is None:
        return None
    try:
        fn = lib(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = (
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint,
    )
    return fn


_syscall = _load(ctypes.CDLL)
_syscall_gil = _load(ctypes.PyDLL)
AVAILABLE: bool = _syscall is not None and _syscall_gil is not None
"""Whether futex calls are available here (else :func:`wait` and :func:`wake` do nothing)."""


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` holds ``expected``, at most ``timeout_s``.

    Returns at once when the word differs, when woken (:func:`wake`), at the timeout, or on
    a signal; the caller checks what it waits for again in every case.

    Args:
        address: the word's address in a shared mapping (4-byte aligned).
        expected: the value read before the caller last checked its condition.
        timeout_s: the longest sleep (seconds).
    """
    if _syscall is None or not AVAILABLE:
        return
    t = max(0.0, timeout_s)
    ts = _Timespec(int(t), int((t - int(t)) * 1e9))
    if (
        _syscall(_SYS_FUTEX, address, _FUTEX_WAIT, expected & 0xFFFFFFFF, ctypes.byref(ts), None, 0)
        < 0
    ):
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(err, f"futex wait: {errno.errorcode.get(err, err)}")


def wake(address: int) -> int:
    """Wake every process waiting on the word at ``address``; how many were woken."""
    if _syscall_gil is None:
        return 0
    return max(0, int(_syscall_gil(_SYS_FUTEX, address, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)))
