"""Shared fixtures: a real kvtierd subprocess per test on ipc:// in a short temp path."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# The shared helpers' asserts are rewritten as the test modules' are, so they check (and
# report their values) under `python -O` too, where plain asserts are stripped.
pytest.register_assert_rewrite("tests.arenas", "tests.engines", "tests.key_chain", "tests.servers")

from kvtier.config.models import NativeKernel  # noqa: E402
from kvtier.kernels import native  # noqa: E402
from kvtier.launch.daemon_process import DaemonProcess  # noqa: E402 (after the rewrite hook)

# Every hypothesis test and state machine runs the same examples on every run: its seed
# comes from the test itself (derandomize) and no example database carries failures from
# one run into the next, so a verdict never depends on an earlier run. Budgets are set per
# test, sized so that planted bugs are found within them. HYPOTHESIS_PROFILE=explore draws
# fresh random examples instead (a longer search, for hunting bugs by hand).
settings.register_profile("kvtier", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvtier"))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path (ipc:// socket paths are limited to ~100 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _daemon_flags(root: Path, name: str, *args: str) -> list[str]:
    """The fixtures' kvtierd flags (see :func:`daemon_factory`), then ``args``."""
    return [
        "--hicache-storage-backend",
        "none",
        "--state-dir",
        str(root / name / "state"),
        "--hicache-size",
        "64MiB",
        "--extent-size",
        "4MiB",
        "--log-level",
        "info",
        "--lease-s",
        "5",
        *args,
    ]


@pytest.fixture
def daemon_factory(short_tmp: Path) -> Iterator:
    """Start kvtierd processes: ``daemon_factory(*flags, name="d0")``; all stopped at teardown.

    Each daemon runs in ``<short_tmp>/<name>`` with L3 off (``--hicache-storage-backend
    none``: most tests are about L2) and ``--state-dir <short_tmp>/<name>/state``, never the
    user's own state directory. ``flags`` come after these, and a later flag wins, so a test
    about L3 passes its own ``--hicache-storage-backend`` (and ``--state-dir``). Both are
    flags, so they also win over a ``--config`` file's keys.
    """
    started: list[DaemonProcess] = []

    def make(
        *args: str, name: str = "d0", env: dict[str, str] | None = None, start: bool = True
    ) -> DaemonProcess:
        d = DaemonProcess(short_tmp / name, _daemon_flags(short_tmp, name, *args), env=env)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        if d.proc is not None:
            d.stop()
        d.remove_pool()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """One running kvtierd with a 64 MiB pool."""
    return daemon_factory()


@pytest.fixture(scope="module")
def module_daemon() -> Iterator[DaemonProcess]:
    """One kvtierd for a whole test module, as :func:`daemon` starts it.

    For modules whose tests only add pages, each in a namespace of its own (e.g. a model id
    per test), so that no test sees another's pages: a daemon start costs seconds.
    """
    root = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    d = DaemonProcess(root / "d0", _daemon_flags(root, "d0"))
    try:
        yield d.start()
    finally:
        if d.proc is not None:
            d.stop()
        d.remove_pool()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def native_off() -> Iterator[Callable[..., None]]:
    """``native_off("region_copy", ...)`` turns those C kernels off in this process
    (:func:`kvtier.kernels.native.configure`; ``native_off()`` turns every one back on);
    what was off before the test is off again after it."""
    previous = native.turned_off()

    def turn_off(*kernels: NativeKernel) -> None:
        native.configure(kernels)

    yield turn_off
    native.configure(previous)
