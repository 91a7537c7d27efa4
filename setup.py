"""Build hook for the C extensions (everything else is in pyproject.toml).

Required (kvtier does not import without them; ``make`` installs the C compiler, the
Python headers and the xxHash header, Debian ``libxxhash-dev``, that they need), each the
one implementation of what it does, with no Python path beside it and no switch:

- ``kvtier.daemon.pool.native._alloc``: a STORE's slot allocation and commit, and the
  ``reuse`` eviction policy's state (``_reuse.h``);
- ``kvtier.daemon.pool.native._pins``: pin and unpin of a run of pages;
- ``kvtier.daemon.pool.native._keyprobe``: the key table's probe of a LOOKUP, an adopted
  pool's key index and its row seals;
- ``kvtier.ipc._packkeys``: page keys packed for the wire (``packed_keys``);
- ``kvtier.kernels._pagekeys``: the SHA-256 chain of page keys (a client's prompts).

Optional (where one does not build, its caller takes its Python or numpy path; the
daemon's ``native_off`` setting turns a built one off, see ``kvtier.kernels.native``):

- ``kvtier.kernels._fileio``: the file L3 backend's batch I/O;
- ``kvtier.kernels._guarded``: copies from engine memfds that may shrink.
"""

from setuptools import Extension, setup

_C = ["-O3", "-std=gnu11"]


def _pool(name: str, headers: tuple[str, ...] = ()) -> Extension:
    """One of the pool's required extensions, ``daemon/pool/native/<name>.c`` (and the
    ``headers`` beside it that it includes)."""
    return Extension(
        f"kvtier.daemon.pool.native.{name}",
        sources=[f"daemon/pool/native/{name}.c"],
        depends=[f"daemon/pool/native/{h}" for h in headers],
        extra_compile_args=_C,
    )


setup(
    ext_modules=[
        _pool("_alloc", ("_reuse.h", "_lists.h")),
        _pool("_pins", ("_lists.h",)),
        _pool("_keyprobe"),  # xxhash.h, inlined: the row seals
        Extension(
            "kvtier.kernels._fileio",
            sources=["kernels/_fileio.c", "kernels/_xxh3_avx2.c"],
            extra_compile_args=["-O3", "-std=c11", "-D_GNU_SOURCE"],
            optional=True,
        ),
        Extension("kvtier.ipc._packkeys", sources=["ipc/_packkeys.c"], extra_compile_args=_C),
        Extension(
            "kvtier.kernels._pagekeys", sources=["kernels/_pagekeys.c"], extra_compile_args=_C
        ),
        Extension(
            "kvtier.kernels._guarded",
            sources=["kernels/_guarded.c"],
            extra_compile_args=_C,
            optional=True,
        ),
    ]
)
