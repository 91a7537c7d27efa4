"""The reference engine on a GPU through a real kvtierd, in both copy modes.

Marked ``cuda``: skipped without an NVIDIA GPU, with the reason. ``bench/gpu_check.sh`` runs
it (``tests/cuda -m cuda``). The model and its KV cache live on ``cuda:0``:

- ``engine``: the KV is plain device tensors; the engine copies pages device ↔ a pinned
  staging area on its own stream, layer by layer, the compute stream waiting on each layer's
  copy; kvtierd copies staging ↔ pool on the CPU (it needs torch with CUDA only);
- ``daemon``: the KV is a ``CudaKVPool`` exported by CUDA IPC; kvtierd copies by DMA on its
  own stream and the compute stream waits on its layer events (needs CuPy in the daemon).

Each: outputs equal to the engine with kvtier off (same weights, same device), a new engine
reusing the first's pages, and reuse after kvtierd restarted. The CPU runs of the same
scenarios are ``tests/integration/test_engine_copy_modes.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvtier.engine.engine import GenerationResult, ReferenceEngine
from kvtier.engine.model import ModelConfig, TinyLlama
from kvtier.ipc import cuda_ipc

from tests.engines import client_config

PAGE = 16
TOL = 1e-3
IPC_REASON = cuda_ipc.cuda_unavailable_reason()
TORCH_REASON = None if torch.cuda.is_available() else "torch reports no CUDA device"

MODES = [
    pytest.param(
        "engine",
        marks=pytest.mark.skipif(TORCH_REASON is not None, reason=TORCH_REASON or ""),
    ),
    pytest.param(
        "daemon",
        marks=pytest.mark.skipif(IPC_REASON is not None, reason=IPC_REASON or ""),
    ),
]


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_same(got: GenerationResult, want: GenerationResult) -> None:
    assert got.tokens == want.tokens
    diff = float((got.first_logits - want.first_logits).abs().max())
    assert diff < TOL, f"first logits differ by {diff}"


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("copy_mode", MODES)
def test_reference_engine_on_cuda_reuses_pages_across_engine_and_kvtierd_restarts(
    daemon_factory, copy_mode: str
) -> None:
    d = daemon_factory()
    model = TinyLlama(ModelConfig.tiny()).to("cuda:0")
    vocab = model.cfg.vocab_size
    cfg = client_config(d.runtime_dir, request_timeout_s=30.0, load_timeout_s=30.0)

    def engine(mode: str = "on") -> ReferenceEngine:
        return ReferenceEngine(
            mode=mode,  # type: ignore[arg-type]
            page_size=PAGE,
            num_pages=64,
            client_config=cfg,
            model=model,
            device="cuda:0",
            copy_mode=copy_mode,  # type: ignore[arg-type]
        )

    off = engine("off")
    first = engine()
    second: ReferenceEngine | None = None
    try:
        assert first.copy_mode == copy_mode and first.k_cache[0].device == torch.device("cuda:0")
        prefix = prompt(10 * PAGE, vocab, 1)
        assert_same(first.generate(prefix + [5], 4), off.generate(prefix + [5], 4))
        first.close()  # an engine restart: the next one has new device memory

        second = engine()
        full = prefix + prompt(37, vocab, 2)
        got = second.generate(full, 12)
        assert (got.cached_l1, got.cached_l2, got.load_failed) == (0, 10 * PAGE, False)
        assert_same(got, off.generate(full, 12))

        second.flush_l1()
        d.stop()
        d.start()  # adopts the pool the first daemon left
        other = prefix + prompt(21, vocab, 3)
        got = second.generate(other, 8)  # re-registers with the new daemon by itself
        assert (got.cached_l2, got.load_failed) == (10 * PAGE, False)
        assert_same(got, off.generate(other, 8))
    finally:
        for e in (second, first, off):
            if e is not None:
                e.close()
