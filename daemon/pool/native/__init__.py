"""The host pool's C code: the one implementation of its hot steps, built at install.

- ``_alloc`` (``_alloc.c``): a STORE's slots allocated (evicting as it goes) and committed;
- ``_pins`` (``_pins.c``): pin and unpin of a run of pages;
- ``_keyprobe`` (``_keyprobe.c``): the key table's probe of a LOOKUP, an adopted pool's key
  index and its row seals.

They are required: ``setup.py`` builds them with the C compiler that ``make`` installs
(``make builddeps``). An install without them fails to import the pool with an
ImportError that says how to build them.
"""

from __future__ import annotations

try:
    from kvtier.daemon.pool.native import _alloc, _keyprobe, _pins
except ImportError as e:  # pragma: no cover - an install without a C compiler
    raise ImportError(
        "kvtier's host pool needs its C extensions (kvtier.daemon.pool.native._alloc, _pins, "
        "_keyprobe), which are not built: install a C compiler and the Python headers "
        "(Debian: `make builddeps`, or apt-get install gcc libc6-dev python3-dev) and "
        f"reinstall kvtier (`pip install -e .`, or `make venv`). ({e})"
    ) from e

__all__ = ["_alloc", "_keyprobe", "_pins"]
