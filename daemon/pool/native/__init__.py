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

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

__all__ = ["_alloc", "_keyprobe", "_pins"]


def _load(name: str) -> ModuleType:
    """The extension ``name`` of this package, or an ImportError that says how to build it."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:  # an install without a C compiler or headers
        raise ImportError(
            f"kvtier's host pool needs its C extension {__name__}.{name}, which is not built: "
            "install a C compiler, the Python headers and xxhash.h (Debian: `make builddeps`, "
            "or apt-get install gcc libc6-dev python3-dev libxxhash-dev) and reinstall kvtier "
            "(`make venv`, or `pip install -e .`)"
        ) from e


if TYPE_CHECKING:  # the stubs beside the sources (_alloc.pyi, ...)
    from kvtier.daemon.pool.native import _alloc, _keyprobe, _pins
else:
    _alloc = _load("_alloc")
    _pins = _load("_pins")
    _keyprobe = _load("_keyprobe")
