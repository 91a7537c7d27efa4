"""The reference engine through a real kvtierd in both copy modes, on the CPU.

``daemon``: kvtierd copies straight into the engine's shared-memory pool. ``engine``: the
engine keeps its KV in private tensors and copies pages through a bounded staging area that
kvtierd maps (the path a GPU engine takes by default). ``fake-cuda``: the ``daemon`` mode's
CUDA branch (a ``CudaKVPool`` exported by "CUDA IPC", the daemon's CUDA session, its layer
events): the CUDA calls are a FAKE for the GPU this machine lacks (:mod:`tests.fake_cuda`,
numpy copies over files both processes map); everything else is the real engine, connection
and kvtierd. In each: outputs equal to the engine with kvtier off, a new engine reusing the
first's pages, and reuse after kvtierd restarted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtier.client.cache.staged import StagedConnection
from kvtier.client.connection.connection import Connection
from kvtier.client.connection.replies import DaemonError
from kvtier.client.kv_pool.cuda import CudaKVPool
from kvtier.engine.engine import GenerationResult, ReferenceEngine
from kvtier.engine.model import EngineInputError, ModelConfig, TinyLlama
from kvtier.ipc.protocol import ErrorCode
from kvtier.launch.daemon_process import DaemonProcess

from tests.conftest import _daemon_flags
from tests.engines import client_config
from tests.fake_cuda import FakeCuda

pytestmark = [pytest.mark.timeout(120)]

TOL = 1e-4
PAGE = 16
KINDS = ("daemon", "engine", "fake-cuda")

MakeEngine = Callable[..., ReferenceEngine]


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_same(got: GenerationResult, want: GenerationResult) -> None:
    assert got.tokens == want.tokens
    diff = float((got.first_logits - want.first_logits).abs().max())
    assert diff < TOL, f"first logits differ by {diff}"


@pytest.fixture(scope="module")
def tiny() -> TinyLlama:
    return TinyLlama(ModelConfig.tiny())


@pytest.fixture
def kvtierd(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[DaemonProcess]:
    """A real kvtierd; for ``fake-cuda`` with the fake CUDA backend installed."""
    fake = request.param == "fake-cuda"
    d = DaemonProcess(
        short_tmp / "d0",
        _daemon_flags(short_tmp, "d0"),
        env={"FAKE_CUDA_DIR": str(short_tmp / "fc")} if fake else None,
        module="tests.fake_cuda_kvtierd" if fake else "kvtier.daemon",
    )
    d.start()
    try:
        yield d
    finally:
        if d.proc is not None:
            d.stop()
        d.remove_pool()


@pytest.fixture
def engines(
    request: pytest.FixtureRequest, kvtierd: DaemonProcess, tiny: TinyLlama, short_tmp: Path
) -> Iterator[MakeEngine]:
    """``make(mode="on", **engine_kwargs)``: engines of the test's kind; closed at the end."""
    kind = request.node.callspec.params["kvtierd"]
    made: list[ReferenceEngine] = []

    def make(mode: str = "on", **kw: object) -> ReferenceEngine:
        args: dict[str, object] = {
            "page_size": PAGE,
            "num_pages": 64,
            "client_config": client_config(kvtierd.runtime_dir),
            "model": tiny,
        }
        if mode == "on":
            if kind == "fake-cuda":
                args.update(copy_mode="daemon", cuda_backend=FakeCuda(short_tmp / "fc"))
            else:
                args["copy_mode"] = kind
        args.update(kw)
        made.append(ReferenceEngine(mode=mode, **args))  # type: ignore[arg-type]
        link = made[-1].connection
        if kind == "fake-cuda" and "copy_mode" not in kw and link is not None:
            assert isinstance(link, Connection) and isinstance(link.pool, CudaKVPool)
        if made[-1].copy_mode == "engine" and link is not None:
            assert isinstance(link, StagedConnection)
        return made[-1]

    yield make
    for e in reversed(made):
        e.close()


def kinds() -> pytest.MarkDecorator:
    return pytest.mark.parametrize("kvtierd", KINDS, indirect=True)


@kinds()
def test_outputs_equal_kvtier_off_and_a_new_engine_reuses_the_pages(
    engines: MakeEngine, tiny: TinyLlama
) -> None:
    vocab = tiny.cfg.vocab_size
    first, off = engines(), engines("off")
    prefix = prompt(10 * PAGE + 5, vocab, 1)
    assert_same(first.generate(prefix, 6), off.generate(prefix, 6))
    assert first.counters is not None and first.counters.pages_stored == 10
    first.close()  # its KV and registration are gone; the next engine has new ones
    second = engines()
    full = prefix[: 10 * PAGE] + prompt(37, vocab, 2)
    got = second.generate(full, 12)
    assert (got.cached_l1, got.cached_l2, got.computed, got.load_failed) == (0, 160, 37, False)
    assert_same(got, off.generate(full, 12))


@kinds()
def test_pages_are_reused_after_kvtierd_restarts(
    engines: MakeEngine, kvtierd: DaemonProcess, tiny: TinyLlama
) -> None:
    vocab = tiny.cfg.vocab_size
    on, off = engines(), engines("off")
    prefix = prompt(8 * PAGE, vocab, 3)
    on.generate(prefix + [1], 2)
    on.flush_l1()
    kvtierd.stop()
    kvtierd.start()  # adopts the pool the first daemon left
    full = prefix + prompt(21, vocab, 4)
    got = on.generate(full, 8)  # the engine re-registers with the new daemon by itself
    assert (got.cached_l2, got.load_failed) == (8 * PAGE, False)
    assert_same(got, off.generate(full, 8))
    fresh = engines()  # a new engine finds them too, and the page stored after the restart
    again = fresh.generate(full, 8)
    assert again.cached_l2 == 9 * PAGE
    assert_same(again, off.generate(full, 8))


@pytest.mark.parametrize("kvtierd", ["daemon"], indirect=True)
@pytest.mark.parametrize(("storer", "loader"), [("daemon", "engine"), ("engine", "daemon")])
def test_both_copy_modes_share_pages(
    engines: MakeEngine, tiny: TinyLlama, storer: str, loader: str
) -> None:
    vocab = tiny.cfg.vocab_size
    off = engines("off")
    prefix = prompt(6 * PAGE, vocab, 5)
    engines(copy_mode=storer).generate(prefix + [7], 1)
    full = prefix + prompt(9, vocab, 6)
    got = engines(copy_mode=loader).generate(full, 6)
    assert got.cached_l2 == 6 * PAGE
    assert_same(got, off.generate(full, 6))


@pytest.mark.parametrize("kvtierd", ["engine"], indirect=True)
def test_a_small_staging_area_bounds_each_transfer_and_outputs_stay_equal(
    engines: MakeEngine, tiny: TinyLlama
) -> None:
    vocab = tiny.cfg.vocab_size
    off = engines("off")
    small = engines(staging_pages=3)
    prefix = prompt(7 * PAGE, vocab, 7)
    small.generate(prefix + [2], 1)
    c = small.counters
    # the chain goes in STOREs of what the area gives stores (one of its three slots):
    # every page stored, none dropped
    assert c is not None and (c.pages_stored, c.store_dropped_pages) == (7, 0)
    assert c.stores_issued == 7
    reader = engines(staging_pages=3)
    full = prefix + prompt(11, vocab, 8)
    got = reader.generate(full, 6)  # L2 holds 7 pages; a load takes at most 3
    assert (got.l2_found, got.cached_l2, got.computed) == (7 * PAGE, 3 * PAGE, 4 * PAGE + 11)
    assert_same(got, off.generate(full, 6))
    link = reader.connection
    assert isinstance(link, StagedConnection)
    assert link.area.free == link.area.capacity  # every slot back once the request ended
    reader.flush_l1()
    held = link.area.acquire(link.area.capacity, 0.0)  # the area is full: a miss, not a wait
    assert held is not None
    other = prefix + prompt(5, vocab, 11)
    got = reader.generate(other, 3)
    assert (got.l2_found, got.cached_l2, got.computed) == (7 * PAGE, 0, len(other))
    assert_same(got, off.generate(other, 3))
    link.area.release(held)


@pytest.mark.parametrize("kvtierd", ["daemon", "fake-cuda"], indirect=True)
def test_the_default_copy_mode_falls_back_to_engine_when_kvtierd_refuses_gpu_memory(
    engines: MakeEngine,
    kvtierd: DaemonProcess,
    tiny: TinyLlama,
    short_tmp: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A GPU pool (here the FAKE CUDA backend) under the default copy mode: a kvtierd that can
    copy GPU memory (``fake-cuda``) keeps ``daemon``; a plain one answers BAD_MEMORY and the
    engine goes on in ``engine`` mode, warning once. Given explicitly, ``daemon`` is not
    replaced: the refusal reaches the caller."""
    vocab = tiny.cfg.vocab_size
    can_copy_gpu = kvtierd.module == "tests.fake_cuda_kvtierd"
    off = engines("off")
    with caplog.at_level("WARNING", logger="kvtier.engine"):
        first = engines(copy_mode=None, cuda_backend=FakeCuda(short_tmp / "fc"))
    warned = [r for r in caplog.records if "using copy_mode 'engine'" in r.getMessage()]
    if can_copy_gpu:
        assert first.copy_mode == "daemon" and not warned
        assert isinstance(first.connection, Connection)
        assert isinstance(first.connection.pool, CudaKVPool)
    else:
        assert first.copy_mode == "engine" and len(warned) == 1
        assert "BAD_MEMORY" in warned[0].getMessage()
        assert isinstance(first.connection, StagedConnection)
        with pytest.raises(DaemonError, match="BAD_MEMORY") as refused:
            engines(copy_mode="daemon", cuda_backend=FakeCuda(short_tmp / "fc"))
        assert refused.value.code == ErrorCode.BAD_MEMORY
    prefix = prompt(5 * PAGE, vocab, 12)
    assert_same(first.generate(prefix + [3], 2), off.generate(prefix + [3], 2))
    full = prefix + prompt(7, vocab, 13)
    got = engines(copy_mode="engine").generate(full, 4)
    assert got.cached_l2 == 5 * PAGE
    assert_same(got, off.generate(full, 4))


def test_default_copy_mode_is_daemon_except_on_cuda_without_cupy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvtier.engine.kv as kv

    assert kv.default_copy_mode(torch.device("cpu")) == "daemon"
    monkeypatch.setattr(kv, "cuda_unavailable_reason", lambda: None)
    assert kv.default_copy_mode(torch.device("cuda", 0)) == "daemon"
    monkeypatch.setattr(kv, "cuda_unavailable_reason", lambda: "needs cupy")
    assert kv.default_copy_mode(torch.device("cuda", 0)) == "engine"
    assert kv.default_copy_mode(torch.device("cpu")) == "daemon"


def test_bad_engine_settings_are_refused_naming_the_value(tiny: TinyLlama) -> None:
    def make(**kw: object) -> ReferenceEngine:
        return ReferenceEngine(mode="off", page_size=PAGE, num_pages=8, model=tiny, **kw)  # type: ignore[arg-type]

    with pytest.raises(EngineInputError, match="copy_mode must be 'daemon' or 'engine', got 'gpu'"):
        make(copy_mode="gpu")
    with pytest.raises(EngineInputError, match="'meta'"):
        make(device="meta")
    with pytest.raises(EngineInputError, match="'nowhere' is not a torch device"):
        make(device="nowhere")
    with pytest.raises(EngineInputError, match=r"staging_pages = 0: must be an integer in \[1, "):
        make(staging_pages=0)
    if not torch.cuda.is_available():
        with pytest.raises(EngineInputError, match=r"'cuda'.*no CUDA device"):
            make(device="cuda")
    with pytest.raises(EngineInputError, match="the model is on meta, the engine's device is cpu"):
        ReferenceEngine(mode="off", num_pages=8, model=TinyLlama(ModelConfig.tiny()).to("meta"))
    assert make().copy_mode == "daemon"  # the CPU's default


class Worker:
    """A reference engine in its own process (:mod:`kvtier.engine.worker`), JSON lines."""

    def __init__(self, runtime_dir: Path, copy_mode: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.engine.worker", "--model", "tiny"]
            + ["--page-size", str(PAGE), "--num-pages", "64", "--copy-mode", copy_mode]
            + ["--runtime-dir", str(runtime_dir), "--threads", "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self.read()

    def read(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the worker exited with {self.proc.wait()}"
        reply: dict[str, object] = json.loads(line)
        return reply

    def ask(self, **req: object) -> dict[str, object]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.mark.parametrize("kvtierd", ["engine"], indirect=True)
def test_a_second_engine_process_reuses_what_a_killed_one_stored(
    kvtierd: DaemonProcess, tiny: TinyLlama
) -> None:
    vocab = tiny.cfg.vocab_size
    prefix = prompt(9 * PAGE, vocab, 9)
    first = Worker(kvtierd.runtime_dir, "engine")
    try:
        assert first.ready["copy_mode"] == "engine"
        rep = first.ask(op="generate", tokens=prefix + [3], max_new_tokens=2, report_stored=True)
        assert rep["ok"] and rep["stored_tokens"] == 9 * PAGE
    finally:
        first.kill()  # SIGKILL: the next process starts cold
    second = Worker(kvtierd.runtime_dir, "engine")
    try:
        full = prefix + prompt(13, vocab, 10)
        rep = second.ask(op="generate", tokens=full, max_new_tokens=5, compare=True)
        assert rep["ok"] and (rep["cached_l2"], rep["load_failed"]) == (9 * PAGE, False)
        assert rep["matches_uncached"] and float(rep["max_abs_diff"]) < TOL  # type: ignore[arg-type]
    finally:
        second.kill()
