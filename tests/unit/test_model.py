"""Exact tests of the reference model over a paged KV cache.

The point of the model is that KV reused from pages gives the same logits as a recompute, so
most tests compare a cached-prefix prefill (pages filled earlier, possibly moved to other page
ids, possibly loaded layer by layer during the forward pass) with a full recompute, and both
with a dense reference written independently here (no pages, explicit softmax).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch
from kvtier.config.errors import ConfigError
from kvtier.engine import ops
from kvtier.engine.model import (
    EngineInputError,
    ModelConfig,
    TinyLlama,
    new_kv_cache,
)

TOL = 1e-4


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="module")
def model(cfg: ModelConfig) -> TinyLlama:
    return TinyLlama(cfg)


def prompt(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def full_logits(model: TinyLlama, tokens: Sequence[int], page_size: int) -> torch.Tensor:
    """All-token logits of a no-cache prefill into a fresh cache."""
    n_pages = -(-len(tokens) // page_size)
    k, v = new_kv_cache(model.cfg, n_pages, page_size)
    return model.prefill(tokens, 0, list(range(n_pages)), k, v, return_all_logits=True)


def dense_reference(model: TinyLlama, tokens: Sequence[int]) -> torch.Tensor:
    """The same network written densely and independently: complex-number RoPE, repeated KV
    heads, an explicit lower-triangular softmax. Returns all-token float32 logits."""
    cfg = model.cfg
    n, hd, nh, nkv = len(tokens), cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    half = hd // 2
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / hd)
    rot = torch.polar(
        torch.ones(n, half, dtype=torch.float64),
        torch.arange(n, dtype=torch.float64)[:, None] * freqs[None, :],
    )

    def rope(x: torch.Tensor) -> torch.Tensor:  # x: [n, heads, hd]
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot[:, None, :]
        return torch.cat((z.real, z.imag), dim=-1).float()

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    x = model.embed[torch.tensor(tokens)].float()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for blk in model.blocks:
        h = norm(x, blk.attn_norm)
        qkv = h @ blk.wqkv.T
        q = rope(qkv[:, : nh * hd].reshape(n, nh, hd))
        k = rope(qkv[:, nh * hd : (nh + nkv) * hd].reshape(n, nkv, hd))
        v = qkv[:, (nh + nkv) * hd :].reshape(n, nkv, hd)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, nh * hd)
        x = x + attn @ blk.wo.T
        h = norm(x, blk.mlp_norm)
        gate, up = (h @ blk.w_gate_up.T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ blk.w_down.T
    return norm(x, model.final_norm) @ model.lm_head.T


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ------------------------------------------------------------------------- reference


@pytest.mark.parametrize("n", [1, 5, 33])
def test_prefill_matches_dense_reference(model: TinyLlama, n: int) -> None:
    tokens = prompt(n, seed=n)
    got = full_logits(model, tokens, page_size=4)
    assert got.shape == (n, model.cfg.vocab_size) and got.dtype == torch.float32
    assert max_diff(got, dense_reference(model, tokens)) < TOL


def test_last_token_logits_are_the_last_row(model: TinyLlama) -> None:
    tokens = prompt(11)
    k, v = new_kv_cache(model.cfg, 3, 4)
    last = model.prefill(tokens, 0, [0, 1, 2], k, v)
    assert last.shape == (model.cfg.vocab_size,)
    assert max_diff(last, full_logits(model, tokens, 4)[-1]) < TOL


# ----------------------------------------------------------------------- cached prefix


@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("n", [9, 16, 30])
def test_cached_prefix_same_pages_matches_recompute(
    model: TinyLlama, page_size: int, n: int
) -> None:
    tokens = prompt(n, seed=100 + n)
    full = full_logits(model, tokens, page_size)
    n_pages = -(-n // page_size)
    table = list(range(n_pages))
    for cached_pages in range(1, (n - 1) // page_size + 1):
        cached = cached_pages * page_size
        k, v = new_kv_cache(model.cfg, n_pages, page_size)
        model.prefill(tokens[:cached], 0, table, k, v)
        got = model.prefill(tokens, cached, table, k, v, return_all_logits=True)
        assert got.shape == (n - cached, model.cfg.vocab_size)
        assert max_diff(got, full[cached:]) < TOL, (page_size, n, cached)
        assert torch.equal(got.argmax(-1), full[cached:].argmax(-1))


@pytest.mark.parametrize("cached_pages", [1, 3, 6])
def test_cached_prefix_copied_to_other_page_ids(model: TinyLlama, cached_pages: int) -> None:
    page_size, n, new_tokens = 4, 27, 12
    tokens = prompt(n, seed=7)
    cached = cached_pages * page_size
    total_pages = -(-(n + new_tokens) // page_size)

    # Fill the prefix into pages 0.. of one cache ...
    src_k, src_v = new_kv_cache(model.cfg, total_pages, page_size)
    model.prefill(tokens[:cached], 0, list(range(total_pages)), src_k, src_v)
    # ... and move it, page by page, to scattered ids of another cache full of garbage.
    pool = 40
    dst_k, dst_v = new_kv_cache(model.cfg, pool, page_size)
    for t in (*dst_k, *dst_v):
        t.fill_(float("nan"))
    table = torch.randperm(pool, generator=torch.Generator().manual_seed(3))[:total_pages]
    table_ids = table.tolist()
    assert table_ids[:cached_pages] != list(range(cached_pages))
    for layer in range(model.cfg.n_layers):
        for p in range(cached_pages):
            dst_k[layer][table_ids[p]].copy_(src_k[layer][p])
            dst_v[layer][table_ids[p]].copy_(src_v[layer][p])

    full = full_logits(model, tokens, page_size)
    got = model.prefill(tokens, cached, table_ids, dst_k, dst_v, return_all_logits=True)
    assert max_diff(got, full[cached:]) < TOL

    # Greedy generation from the moved prefix equals generation with nothing cached.
    ref_k, ref_v = new_kv_cache(model.cfg, total_pages, page_size)
    want, want_first = model.generate(tokens, 0, list(range(total_pages)), ref_k, ref_v, new_tokens)
    got_ids, got_first = model.generate(tokens, cached, table_ids, dst_k, dst_v, new_tokens)
    assert got_ids == want
    assert max_diff(got_first, want_first) < TOL


def test_page_table_may_be_a_tensor(model: TinyLlama) -> None:
    tokens = prompt(10)
    k, v = new_kv_cache(model.cfg, 5, 4)
    a = model.prefill(tokens, 0, torch.tensor([4, 0, 2]), k, v)
    b = model.prefill(tokens, 0, [4, 0, 2], k, v)
    assert torch.equal(a, b)


@pytest.mark.parametrize(("n", "cached"), [(5, 3), (13, 7), (13, 12), (2, 1)])
def test_unaligned_cached_len_matches_recompute(model: TinyLlama, n: int, cached: int) -> None:
    tokens = prompt(n, seed=n)
    k, v = new_kv_cache(model.cfg, 4, 4)
    model.prefill(tokens[:cached], 0, [3, 1, 0, 2], k, v)
    got = model.prefill(tokens, cached, [3, 1, 0, 2], k, v, return_all_logits=True)
    assert max_diff(got, full_logits(model, tokens, 4)[cached:]) < TOL


def test_offset_attention_in_several_chunks(
    model: TinyLlama, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(40, seed=5)
    full = full_logits(model, tokens, 4)
    monkeypatch.setattr(ops, "ATTN_CHUNK", 3)
    calls: list[int] = []
    real_sdpa = ops.sdpa

    def counting_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "sdpa", counting_sdpa)
    k, v = new_kv_cache(model.cfg, 10, 4)
    model.prefill(tokens[:8], 0, list(range(10)), k, v)
    calls.clear()
    got = model.prefill(tokens, 8, list(range(10)), k, v, return_all_logits=True)
    assert max_diff(got, full[8:]) < TOL
    assert len(calls) == model.cfg.n_layers * math.ceil(32 / 3)  # the chunked path ran


def test_gqa_fallback_matches(model: TinyLlama, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(21, seed=9)
    k, v = new_kv_cache(model.cfg, 6, 4)
    model.prefill(tokens[:12], 0, list(range(6)), k, v)
    fused = model.prefill(tokens, 12, list(range(6)), k, v, return_all_logits=True)
    monkeypatch.setattr(ops, "SDPA_HAS_GQA", not ops.SDPA_HAS_GQA)
    gqa_flags: list[bool] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        gqa_flags.append(bool(kwargs.get("enable_gqa", False)))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    other = model.prefill(tokens, 12, list(range(6)), k, v, return_all_logits=True)
    assert max_diff(fused, other) < TOL
    assert gqa_flags and set(gqa_flags) == {ops.SDPA_HAS_GQA}  # the other path ran


# ------------------------------------------------------------------------- layer waits


def test_layer_wait_loads_each_layer_just_in_time(model: TinyLlama) -> None:
    """Simulate kvtier's per-layer load: the prefix pages hold NaN until ``layer_wait(i)``
    copies layer i in. A layer that read its cache before its wait would produce NaN."""
    page_size, n, cached = 4, 22, 16
    tokens = prompt(n, seed=11)
    table = [5, 2, 7, 0, 3, 1]
    src_k, src_v = new_kv_cache(model.cfg, 8, page_size)
    model.prefill(tokens[:cached], 0, table, src_k, src_v)
    dst_k, dst_v = new_kv_cache(model.cfg, 8, page_size)
    for t in (*dst_k, *dst_v):
        t.fill_(float("nan"))

    calls: list[int] = []

    def wait(layer: int) -> None:
        # Layers after this one must still be unloaded: nothing has run them yet.
        assert all(torch.isnan(dst_k[later]).all() for later in range(layer + 1, len(dst_k)))
        calls.append(layer)
        for p in table[: cached // page_size]:
            dst_k[layer][p].copy_(src_k[layer][p])
            dst_v[layer][p].copy_(src_v[layer][p])

    got = model.prefill(
        tokens, cached, table, dst_k, dst_v, layer_wait=wait, return_all_logits=True
    )
    assert calls == list(range(model.cfg.n_layers))
    assert torch.isfinite(got).all()
    assert max_diff(got, full_logits(model, tokens, page_size)[cached:]) < TOL


def test_layer_wait_called_once_per_layer_without_cache(model: TinyLlama) -> None:
    calls: list[int] = []
    k, v = new_kv_cache(model.cfg, 3, 4)
    model.prefill(prompt(9), 0, [0, 1, 2], k, v, layer_wait=calls.append)
    assert calls == list(range(model.cfg.n_layers))
    calls.clear()
    model.generate(prompt(9), 4, [0, 1, 2], k, v, 3, layer_wait=calls.append)
    assert calls == list(range(model.cfg.n_layers))


# ------------------------------------------------------------------- cache and decoding


def test_writes_only_its_own_pages_in_place(model: TinyLlama) -> None:
    k, v = new_kv_cache(model.cfg, 6, 4)
    for t in (*k, *v):
        t.fill_(7.0)
    ptrs = [t.data_ptr() for t in (*k, *v)]
    model.prefill(prompt(10), 0, [4, 1, 3], k, v)
    assert [t.data_ptr() for t in (*k, *v)] == ptrs
    for t in (*k, *v):
        assert (t[[0, 2, 5]] == 7.0).all()  # pages outside the table are untouched
        assert (t[3, 2:] == 7.0).all()  # positions 10, 11 of the last page too
        assert not (t[4] == 7.0).any() and not (t[3, :2] == 7.0).any()


def test_decode_matches_teacher_forced_prefill(model: TinyLlama) -> None:
    """Greedy decoding across page boundaries equals one prefill of prompt + output."""
    tokens = prompt(6, seed=21)
    k, v = new_kv_cache(model.cfg, 8, 4)
    out, first = model.generate(tokens, 0, [6, 0, 7, 1, 5, 2], k, v, 17)
    assert len(out) == 17
    everything = full_logits(model, tokens + out[:-1], 4)
    assert max_diff(first, everything[len(tokens) - 1]) < TOL
    assert everything[len(tokens) - 1 :].argmax(-1).tolist() == out


def test_decode_step_matches_prefill_row(model: TinyLlama) -> None:
    tokens = prompt(13, seed=4)
    k, v = new_kv_cache(model.cfg, 4, 4)
    model.prefill(tokens[:12], 0, [2, 0, 3, 1], k, v)
    step = model.decode(tokens[12], 12, [2, 0, 3, 1], k, v)
    assert step.shape == (model.cfg.vocab_size,)
    assert max_diff(step, full_logits(model, tokens, 4)[12]) < TOL


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_generate_produces_varied_tokens(which: str) -> None:
    cfg = getattr(ModelConfig, which)()
    m = TinyLlama(cfg)
    k, v = new_kv_cache(cfg, 16, 8)
    out, first = m.generate(prompt(20, seed=2, vocab=cfg.vocab_size), 0, list(range(16)), k, v, 40)
    assert len(out) == 40 and all(0 <= t < cfg.vocab_size for t in out)
    assert len(set(out)) >= 10, out
    assert torch.isfinite(first).all() and float(first.std()) > 0.1


def test_generate_zero_tokens_returns_first_logits(model: TinyLlama) -> None:
    k, v = new_kv_cache(model.cfg, 2, 4)
    out, first = model.generate(prompt(8), 0, [0, 1], k, v, 0)
    assert out == [] and first.shape == (model.cfg.vocab_size,)


def test_bfloat16_cache(cfg: ModelConfig) -> None:
    bcfg = dataclasses.replace(cfg, dtype=torch.bfloat16)
    m = TinyLlama(bcfg)
    k, v = new_kv_cache(bcfg, 4, 4)
    assert k[0].dtype == torch.bfloat16
    out, first = m.generate(prompt(9), 0, [0, 1, 2, 3], k, v, 4)
    assert first.dtype == torch.float32 and torch.isfinite(first).all() and len(out) == 4


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_model_other_seed_differs(cfg: ModelConfig) -> None:
    a, b = TinyLlama(cfg), TinyLlama(cfg)
    c = TinyLlama(dataclasses.replace(cfg, seed=cfg.seed + 1))
    tokens = prompt(15)
    la, lb, lc = (full_logits(m, tokens, 4) for m in (a, b, c))
    assert torch.equal(la, lb)
    assert max_diff(la, lc) > 0.1
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)


# -------------------------------------------------------------------------------- errors


def test_bad_inputs_raise(model: TinyLlama) -> None:
    k, v = new_kv_cache(model.cfg, 4, 4)
    tokens = prompt(9)
    with pytest.raises(EngineInputError, match="cached_len"):
        model.prefill(tokens, 9, [0, 1, 2], k, v)
    with pytest.raises(EngineInputError, match="cached_len"):
        model.prefill(tokens, -1, [0, 1, 2], k, v)
    with pytest.raises(EngineInputError, match="page_table"):
        model.prefill(tokens, 0, [0, 1], k, v)
    with pytest.raises(EngineInputError, match="page ids"):
        model.prefill(tokens, 0, [0, 1, 4], k, v)
    with pytest.raises(EngineInputError, match="token ids"):
        model.prefill([1, 256], 0, [0], k, v)
    with pytest.raises(EngineInputError, match="empty"):
        model.prefill([], 0, [0], k, v)
    with pytest.raises(EngineInputError, match="page_table"):
        model.generate(tokens, 0, [0, 1, 2], k, v, 5)  # 9 + 5 - 1 = 13 positions > 12
    with pytest.raises(EngineInputError, match="K and V"):
        model.prefill(tokens, 0, [0, 1, 2], k[:1], v)
    bad_k = [
        *k[:-1],
        torch.zeros(4, 4, model.cfg.n_kv_heads, model.cfg.head_dim, dtype=torch.float64),
    ]
    with pytest.raises(EngineInputError, match="layer 1"):
        model.prefill(tokens, 0, [0, 1, 2], bad_k, v)
    with pytest.raises(EngineInputError, match="num_pages"):
        model.prefill(tokens, 0, [0, 1, 2], [t.view(4, 4, -1) for t in k], v)
    with pytest.raises(EngineInputError, match="position"):
        model.decode(1, -1, [0], k, v)


def test_generate_page_table_bound_is_exact(model: TinyLlama) -> None:
    k, v = new_kv_cache(model.cfg, 4, 4)
    out, _ = model.generate(prompt(9), 0, [0, 1, 2], k, v, 4)  # 9 + 4 - 1 = 12 positions
    assert len(out) == 4


@pytest.mark.parametrize(
    ("field", "value"), [("n_kv_heads", 3), ("head_dim", 15), ("n_layers", 0), ("norm_eps", 0.0)]
)
def test_config_validation(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(ModelConfig.tiny(), **{field: value})


def test_config_helpers() -> None:
    cfg = ModelConfig.tiny()
    assert cfg.kv_page_shape(16) == (16, cfg.n_kv_heads, cfg.head_dim)
    assert cfg.kv_bytes_per_token() == 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
