"""Fixtures for the SGLang backend tests: kvtierd processes and SGLang instance processes.

Every "instance" is a process of its own running SGLang 0.5.23's real host pool and
``HiCacheController`` (``sglang_instance.py``); the tests never import SGLang themselves.
They are skipped when SGLang is not installed in this interpreter's environment.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier.launch.daemon_process import DaemonProcess
from sglang_harness import Instance, start_daemon

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed (the engine test venv has sglang 0.5.23)", allow_module_level=True
    )


@pytest.fixture(scope="module")
def module_tmp() -> Iterator[Path]:
    """A short temp dir for the module (ipc:// socket paths are limited to ~100 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvsg-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def daemons(module_tmp: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start kvtierd processes: ``daemons(name, *flags)``; stopped and their pools removed
    at the end of the module."""
    started: list[DaemonProcess] = []

    def make(name: str, *args: str) -> DaemonProcess:
        d = start_daemon(module_tmp / name, *args)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()
        d.remove_pool()


@pytest.fixture(scope="module")
def instances(module_tmp: Path) -> Iterator[Callable[..., Instance]]:
    """Start SGLang instance processes: ``instances(name, layout, extra, **cfg)`` (they
    start at once and are waited for at their first call); closed at the end of the module."""
    started: list[Instance] = []

    def make(name: str, layout: str, extra: dict[str, Any], **cfg: Any) -> Instance:
        inst = Instance(module_tmp, name, layout, extra, **cfg)
        started.append(inst)
        return inst

    yield make
    for inst in started:
        inst.close()
