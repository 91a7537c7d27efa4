"""Which of kvtier's switchable C kernels this process uses: the one place that says so.

Most of kvtier's C is required and switches nothing: the host pool's extensions
(``daemon/pool/native``: allocation, pins, the key table's probe, an adopted pool's index
and row seals), the page-key chain (``kernels/_pagekeys.c``, :mod:`kvtier.client.page_keys`)
and the packer of wire keys (``ipc/_packkeys.c``, :func:`kvtier.ipc.packed.pack_keys`) are
built at install (``setup.py``; kvtier does not import without them) and are the one
implementation of what they do, for every input, with no Python path and no switch. The
other two, ``_fileio`` and ``_guarded``, are optional (``_fileio`` also needs
``xxhash.h``): where one is not built, its callers take their Python or numpy path. Four
kernels of theirs can also be turned off, each named by the path it takes over:

- ``file_io``: ``_fileio``, the file L3 backend's page I/O and the L3 object headers
  (:mod:`kvtier.kernels.file_io`, :mod:`kvtier.daemon.storage.objects`); off: the same
  calls in Python, page by page.
- ``guarded_copy``: ``_guarded``'s copies over engine memory that may shrink
  (:func:`kvtier.kernels.guarded_copy.copy_pages`); off: such memory is never mapped and is
  copied with ``pread``/``pwrite``.
- ``region_copy``: ``_guarded``'s one-call copies of mapped regions
  (:func:`~kvtier.kernels.guarded_copy.copy_strided`, ``copy_regions``); off: numpy copy
  plans.
- ``copy_threads``: ``_guarded``'s queue of the daemon's copy threads, which run a
  transfer's region copies in C without taking the GIL
  (:class:`~kvtier.daemon.transfer.copy_threads.CopyThreads`); off (or with
  ``region_copy`` off): every copy is a Python callable on the threads
  (:class:`~kvtier.daemon.transfer.fair_pool.FairExecutor`).

The daemon applies its ``native_off`` setting here at start (:func:`configure`): in TOML
``native_off = ["file_io"]``, on the command line ``--native-off '["file_io"]'``, and, as
for every setting, in the environment as ``KVTIER_NATIVE_OFF='["file_io"]'``, read by the
config loader and nowhere else. A process that never configures (a benchmark, a unit test)
uses every kernel that is built. The choice is per process, as the code that runs is, and
is made once, before the first copy: the kernels' modules ask :func:`enabled` at each call,
but the daemon also decides at REGISTER whether to map an engine's memory by it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import get_args

from kvtier.config.models import NativeKernel

__all__ = ["KERNELS", "NativeKernel", "configure", "enabled", "turned_off"]

KERNELS: frozenset[NativeKernel] = frozenset(get_args(NativeKernel))
"""Every switchable kernel's name."""

_off: frozenset[NativeKernel] = frozenset()


def configure(off: Iterable[NativeKernel]) -> frozenset[NativeKernel]:
    """Turn the kernels in ``off`` off for this process, and every other one on.

    Args:
        off: kernel names (:data:`KERNELS`).

    Returns:
        The kernels that were off before (to put back: ``configure(previous)``).

    Raises:
        ValueError: a name that is not a kernel's (named, with the known ones).
    """
    global _off
    wanted = frozenset(off)
    unknown = sorted(str(k) for k in wanted - KERNELS)
    if unknown:
        raise ValueError(
            f"native_off: {', '.join(map(repr, unknown))} is not a kernel "
            f"(known: {', '.join(sorted(KERNELS))})"
        )
    previous, _off = _off, wanted
    return previous


def enabled(kernel: NativeKernel) -> bool:
    """Whether ``kernel`` may be used (whether it is built is its module's to say)."""
    return kernel not in _off


def turned_off() -> frozenset[NativeKernel]:
    """The kernels turned off now."""
    return _off
