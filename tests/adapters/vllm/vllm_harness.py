"""Real vLLM engines in subprocesses, and what the tests ask kvtierd about them.

:class:`EngineProcess` runs ``vllm_engine_proc.py`` (a real ``vllm.LLM``) and talks to it in
JSON lines; every wait has a deadline. :func:`make_tiny_llama` writes a small random Llama
(in a subprocess, so the test process never imports transformers). :func:`kvtier_pages`
asks kvtierd, through a control-only session of the same namespace as the engines', how
many of a prompt's pages it holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvtier.client.adapters.vllm.namespace import CPU_LAYOUT, chain_seed
from kvtier.client.connection.connection import Connection
from kvtier.client.kv_pool.regions import ControlOnly, RegionMemory
from kvtier.client.page_keys import page_keys
from kvtier.config import ClientConfig
from kvtier.ipc import protocol as P
from kvtier.ipc.protocol import Geometry
from kvtier.ipc.shm import SharedMemorySegment

HERE = Path(__file__).parent
BLOCK = 32
"""vLLM block size of the tests (the CPU backend needs a multiple of 32)."""

TINY = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""A Llama whose prefill of a few hundred tokens takes milliseconds (head_dim 64)."""

GEOMETRY = Geometry(
    num_layers=4, page_size=BLOCK, kv_heads=2, head_dim=64, dtype="bfloat16", layout=CPU_LAYOUT
)
"""kvtier's page geometry of :data:`TINY` under vLLM's CPU backend."""

_MAKE_MODEL = """
import sys, json, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(initializer_range=0.3, max_position_embeddings=8192, **json.loads(sys.argv[2]))
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1], safe_serialization=True)
"""


def make_tiny_llama(path: Path, config: dict[str, int] | None = None) -> Path:
    """Write a random bf16 Llama (initializer_range 0.3: outputs depend on the context)."""
    subprocess.run(
        [sys.executable, "-c", _MAKE_MODEL, str(path), json.dumps(config or TINY)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return path


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids, different per seed."""
    return [(seed * 7919 + i * 37 + (i * i) % 101) % 1000 + 3 for i in range(n)]


README = Path(__file__).resolve().parents[3] / "README.md"


def readme_kv_transfer_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON of README.md's vLLM section (the server command), as a
    user copies it; the tests configure vLLM with exactly that (the extra config aside)."""
    text = README.read_text()
    section = text[text.index("## Using kvtier with vLLM") :]
    section = section[: section.index("\n## ", 1)]
    match = re.search(r"--kv-transfer-config '(\{.*?\})'", section, re.DOTALL)
    assert match, "README's vLLM section has no --kv-transfer-config"
    return json.loads(match.group(1))


SHM = Path("/dev/shm")


def _vllm_shm() -> set[str]:
    """Names of vLLM's tensor-parallel shared-memory segments now in /dev/shm."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("vllm_dist_")}
    except FileNotFoundError:
        return set()


class EngineError(RuntimeError):
    """The engine process died or did not answer in time."""


class EngineProcess:
    """One vLLM engine in a subprocess.

    Args:
        model: the model directory.
        kvtier: the connector's extra config (None: no connector).
        multiprocess: vLLM's default three processes (else engine core in-process).
        log: where the engine's stderr goes.
        extra: more engine settings (see vllm_engine_proc.py).
    """

    def __init__(
        self,
        model: Path,
        kvtier: dict[str, Any] | None,
        log: Path,
        multiprocess: bool = False,
        **extra: Any,
    ) -> None:
        env = dict(
            os.environ,
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
        )
        record = not multiprocess and extra.get("tp", 1) == 1  # the worker runs in-process
        cfg = json.dumps(
            {
                "kvtier": kvtier,
                "kv_transfer": readme_kv_transfer_config(),
                "record_loads": record,
                **extra,
            }
        )
        self.log_path = log
        self._shm_before = _vllm_shm()
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "vllm_engine_proc.py"), str(model), cfg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
        )
        self._buf = b""

    def wait_ready(self, timeout: float = 180.0) -> EngineProcess:
        """Block until the engine is up."""
        if not self._read(timeout).get("ready"):
            raise EngineError("engine did not report ready")
        return self

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"no answer within {timeout}s; log tail:\n{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EngineError(
                        f"engine exited ({self.proc.wait()}); log tail:\n{self.log_tail()}"
                    )
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, prompts: list[list[int]], max_tokens: int = 8, salt: str = "") -> None:
        """Send a generate request (answered by :meth:`receive`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            json.dumps({"prompts": prompts, "max_tokens": max_tokens, "salt": salt}).encode()
            + b"\n"
        )
        self.proc.stdin.flush()

    def receive(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        """The answer to the last request: per prompt ``tokens``, ``logprobs``, ``cached``."""
        rep = self._read(timeout)
        if not rep.get("ok"):
            raise EngineError(f"request failed: {rep}")
        return rep["outputs"]

    def generate(
        self, prompts: list[list[int]], max_tokens: int = 8, salt: str = "", timeout: float = 120.0
    ) -> list[dict[str, Any]]:
        """Greedy generation; per prompt ``tokens``, ``logprobs`` and ``cached`` tokens."""
        self.send(prompts, max_tokens, salt)
        return self.receive(timeout)

    def loads(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The connector's loads that ended since the last call (see vllm_engine_proc.py:
        per load its blocks, those reported not loaded, and each block's SHA-256 when vLLM
        was told the load ended). Only for an engine whose worker runs in-process."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b'{"loads": true}\n')
        self.proc.stdin.flush()
        rep = self._read(timeout)
        if not rep.get("ok"):
            raise EngineError(f"loads request failed: {rep}")
        return rep["loads"]

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the engine's stderr."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL the engine and all its processes."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._close_files()

    def _close_files(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self._log):
            if f is not None and not f.closed:
                f.close()
        # vLLM's CPU tensor-parallel communicator (its C++ shm manager) never unlinks its
        # segments; once the engine is gone, the ones that appeared during its life are its own
        for name in _vllm_shm() - self._shm_before:
            (SHM / name).unlink(missing_ok=True)

    def close(self, timeout: float = 60.0) -> int:
        """Let the engine exit (stdin closed); SIGKILL it past ``timeout``. Its exit code."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_files()
        return self.proc.returncode


def same_output(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Same tokens and same logprobs, prompt by prompt."""
    return [(o["tokens"], o["logprobs"]) for o in a] == [(o["tokens"], o["logprobs"]) for o in b]


def same_tokens(a: list[dict[str, Any]], b: list[dict[str, Any]], logprob_tol: float) -> bool:
    """Same tokens, and logprobs within ``logprob_tol``, prompt by prompt: for runs whose
    requests may be batched differently from the reference's (vLLM's CPU kernels round
    differently for another batch shape), where the bytes loaded are checked apart."""
    return all(
        x["tokens"] == y["tokens"]
        and len(x["logprobs"]) == len(y["logprobs"])
        and all(abs(p - q) <= logprob_tol for p, q in zip(x["logprobs"], y["logprobs"]))
        for x, y in zip(a, b, strict=True)
    )


def kvtier_pages(
    runtime_dir: Path, model: Path, tokens: list[int], salt: str = ""
) -> tuple[int, int]:
    """(pages in L2, then pages in L3) of ``tokens`` in the engines' namespace."""
    conn = Connection(
        ControlOnly(GEOMETRY), model_id=str(model), config=ClientConfig(runtime_dir=runtime_dir)
    )
    try:
        keys = page_keys(chain_seed(conn.ns_fingerprint, salt), tokens, BLOCK)
        rep = conn.lookup(keys)
        return rep.l2, rep.l3
    finally:
        conn.close()


def stored_digests(
    runtime_dir: Path, model: Path, tokens: list[int], pages: int, salt: str = ""
) -> list[str]:
    """SHA-256 of each of the first ``pages`` pages kvtierd holds for ``tokens`` in the
    engines' namespace (all layers in layer order, as vllm_engine_proc.py digests a vLLM
    block): loaded by a connection of its own into memory of its own."""
    g = GEOMETRY
    seg = SharedMemorySegment.create_memfd(f"kvt-digests-{os.getpid()}", pages * g.page_bytes)
    try:
        per_layer = g.page_bytes // g.num_layers
        regions = [
            P.MemoryRegion(
                segment=0,
                offset=layer * per_layer,
                page_stride=g.page_bytes,
                page_bytes=per_layer,
                layer=layer,
            )
            for layer in range(g.num_layers)
        ]
        assert seg.fd is not None
        memory = RegionMemory(g, pages, [seg.fd], [seg.size], regions)
        with Connection(
            memory, model_id=str(model), config=ClientConfig(runtime_dir=runtime_dir)
        ) as conn:
            keys = page_keys(chain_seed(conn.ns_fingerprint, salt), tokens[: pages * BLOCK], BLOCK)
            h = conn.load(keys, list(range(pages)))
            assert h.count == pages and h.wait(), f"kvtierd holds {h.count} of {pages} pages"
        raw = seg.array(np.uint8)
        return [
            hashlib.sha256(raw[i * g.page_bytes : (i + 1) * g.page_bytes].tobytes()).hexdigest()
            for i in range(pages)
        ]
    finally:
        seg.close()


def assert_loaded_as_stored(
    engine: EngineProcess,
    runtime_dir: Path,
    model: Path,
    expected: list[tuple[list[int], int]],
    salt: str = "",
) -> None:
    """Check what ``engine``'s connector loaded since it was last asked: for each
    ``(prompt, pages)`` one load, into blocks for pages ``start .. pages`` of the prompt
    (all of its hit beyond vLLM's own), none reported as failed, each block holding
    exactly the bytes kvtierd holds for its page; and no other load."""
    loads = engine.loads()
    for tokens, pages in expected:
        mine = [x for x in loads if x["tokens"] == tokens[: len(x["tokens"])]]
        assert len(mine) == 1, f"{len(mine)} loads of the prompt of {len(tokens)} tokens"
        (load,) = mine
        assert load["errors"] == [], f"blocks {load['errors']} were reported not loaded"
        assert load["start"] + len(load["block_ids"]) == pages, (
            f"pages {load['start']}..{load['start'] + len(load['block_ids'])} loaded, "
            f"the hit is {pages} pages"
        )
        want = stored_digests(runtime_dir, model, tokens, pages, salt)[load["start"] :]
        got = load["digests"]
        assert got == want, (
            f"blocks {load['block_ids']}: pages "
            f"{[i for i, (a, b) in enumerate(zip(got, want)) if a != b]} of the "
            "load do not hold what kvtierd stored"
        )
    assert len(loads) == len(expected), f"{len(loads)} loads, {len(expected)} expected"


def wait_for_pages(
    runtime_dir: Path,
    model: Path,
    tokens: list[int],
    pages: int,
    salt: str = "",
    timeout: float = 30.0,
) -> None:
    """Wait until kvtierd's L2 holds ``pages`` leading pages of ``tokens``."""
    deadline = time.monotonic() + timeout
    while kvtier_pages(runtime_dir, model, tokens, salt)[0] < pages:
        if time.monotonic() > deadline:
            raise AssertionError(f"kvtierd did not get {pages} pages in {timeout}s")
        time.sleep(0.05)
