"""Build hook for the C extensions (everything else is in pyproject.toml):
``kvtier.kernels._fileio`` (the file L3 backend's batch I/O), ``kvtier.kernels._keyprobe``
(the host pool's key index: a long LOOKUP's probe, an adopted pool's dict and row seals),
``kvtier.kernels._pins`` (pin and unpin of a run of pages) and ``kvtier.kernels._guarded``
(copies from engine memfds that may shrink; without it such memory is copied with
pread/pwrite). All are optional: without a C compiler or the xxHash header (Debian:
``libxxhash-dev``; ``make`` installs it) the install still succeeds, and each caller takes
its pure-Python or numpy path (``kvtier.kernels.file_io.BUILT`` and the like are then
False; the daemon's ``native_off`` setting turns a built kernel off, see
``kvtier.kernels.native``)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.kernels._fileio",
            sources=["kernels/_fileio.c", "kernels/_xxh3_avx2.c"],
            extra_compile_args=["-O3", "-std=c11", "-D_GNU_SOURCE"],
            optional=True,
        ),
        Extension(
            "kvtier.kernels._keyprobe",
            sources=["kernels/_keyprobe.c"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "kvtier.kernels._alloc",
            sources=["kernels/_alloc.c"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "kvtier.kernels._pins",
            sources=["kernels/_pins.c"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "kvtier.kernels._guarded",
            sources=["kernels/_guarded.c"],
            extra_compile_args=["-O3", "-std=gnu11"],
            optional=True,
        ),
    ]
)
