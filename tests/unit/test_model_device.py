"""The reference model keeps every tensor of its computation on its own device.

On a GPU the weights and the KV cache are CUDA tensors; positions, masks, token ids and the page
table must follow them. torch's ``meta`` device checks that here without a GPU: any CPU tensor
that enters a computation on meta tensors raises.
"""

from __future__ import annotations

import pytest
import torch
from kvtier.engine.model import EngineInputError, TinyLlama
from kvtier.engine.model_config import ModelConfig, new_kv_cache
from kvtier.engine.ops import offset_masks

PAGE = 4


@pytest.fixture(scope="module")
def meta_model() -> TinyLlama:
    return TinyLlama(ModelConfig.tiny()).to("meta")


def test_prefill_with_a_cached_prefix_runs_on_the_meta_device(meta_model: TinyLlama) -> None:
    cfg = meta_model.cfg
    k_cache, v_cache = new_kv_cache(cfg, 8, PAGE, device="meta")
    tokens = [i % cfg.vocab_size for i in range(3 * PAGE + 1)]
    waited: list[int] = []
    logits = meta_model.prefill(
        tokens,
        2 * PAGE,
        [5, 1, 6, 2],
        k_cache,
        v_cache,
        layer_wait=waited.append,
        return_all_logits=True,
    )
    assert logits.device.type == "meta"
    assert tuple(logits.shape) == (PAGE + 1, cfg.vocab_size)
    assert waited == list(range(cfg.n_layers))


def test_uncached_prefill_and_decode_run_on_the_meta_device(meta_model: TinyLlama) -> None:
    cfg = meta_model.cfg
    k_cache, v_cache = new_kv_cache(cfg, 4, PAGE, device="meta")
    first = meta_model.prefill(list(range(PAGE + 2)), 0, [3, 0, 1], k_cache, v_cache)
    assert first.device.type == "meta" and tuple(first.shape) == (cfg.vocab_size,)
    step = meta_model.decode(7, PAGE + 2, torch.tensor([3, 0, 1]), k_cache, v_cache)
    assert step.device.type == "meta" and tuple(step.shape) == (cfg.vocab_size,)


def test_a_kv_cache_on_another_device_is_refused_naming_both(meta_model: TinyLlama) -> None:
    k_cache, v_cache = new_kv_cache(meta_model.cfg, 4, PAGE)  # on the CPU
    with pytest.raises(EngineInputError, match="on cpu, the model on meta"):
        meta_model.prefill([1, 2, 3], 0, [0], k_cache, v_cache)


def test_masks_are_made_on_the_device_asked_for() -> None:
    masks = offset_masks(PAGE, 3, "meta")
    assert masks and all(m.device.type == "meta" for m in masks)
