"""A small Llama-style decoder that runs over a paged KV cache.

This is the model half of kvtier's reference engine: a real (randomly initialised, seeded)
decoder with RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP.
It exists so that kvtier's reuse of KV can be checked exactly: logits computed over a prefix
whose K/V came from the cache must match a full recompute.

The KV cache is owned by the caller (it lives in shared memory, exported to ``kvtierd``) and
is only ever written in place. Layout ``layer_first``::

    k_cache[l], v_cache[l] : [num_pages, page_size, n_kv_heads, head_dim]   (one pair per layer)

    token position p  ->  page page_table[p // page_size], offset p % page_size

    page_table = [7, 2, 9]      page_size = 4
    positions    0 1 2 3 | 4 5 6 7 | 8 9 ..
    pages        <-- 7 -->  <-- 2 -->  <-- 9 -->

Keys are stored after the rotary embedding, so a cached page is position-dependent but
otherwise self-contained: copying a page to another page id, or to another process, keeps it
valid as long as it is placed at the same position of a request's page table.

The configuration (:class:`ModelConfig`, :func:`new_kv_cache`) is in
:mod:`kvtier.engine.model_config` and the tensor operations in
:mod:`kvtier.engine.ops`; both names are imported here for the model's users.
``python -m kvtier.engine.model`` times the default model on this machine.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from kvtier.config.errors import KvtierError
from kvtier.engine.model_config import ModelConfig, new_kv_cache
from kvtier.engine.ops import apply_rope, attention, offset_masks, rms_norm
from torch import nn

__all__ = [
    "EngineInputError",
    "LayerWait",
    "ModelConfig",
    "TinyLlama",
    "new_kv_cache",
]

LayerWait = Callable[[int], None]
"""Called with a layer index just before that layer touches the KV cache."""


class EngineInputError(KvtierError, ValueError):
    """A model call got bad input: tokens, positions, page table or KV cache geometry."""


def _frozen(t: torch.Tensor) -> nn.Parameter:
    """A weight that never takes a gradient (the model is inference only)."""
    return nn.Parameter(t, requires_grad=False)


class _Block(nn.Module):
    """One pre-norm decoder layer's weights (the computation lives in :class:`TinyLlama`)."""

    def __init__(self, cfg: ModelConfig, g: torch.Generator) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.ffn_size
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

        def rand(rows: int, cols: int) -> nn.Parameter:
            # std 1/sqrt(fan_in): every projection keeps unit-scale activations, so each
            # layer's contribution is comparable to the residual stream and float32 stays sane.
            w = torch.randn(rows, cols, generator=g) / math.sqrt(cols)
            return _frozen(w.to(cfg.dtype))

        self.attn_norm = _frozen(torch.ones(d, dtype=cfg.dtype))
        self.wqkv = rand(q_out + 2 * kv_out, d)
        self.wo = rand(d, q_out)
        self.mlp_norm = _frozen(torch.ones(d, dtype=cfg.dtype))
        self.w_gate_up = rand(2 * f, d)
        self.w_down = rand(d, f)


class TinyLlama(nn.Module):
    """A Llama-style decoder over a paged KV cache; inference only, deterministic per seed.

    Architecture: token embedding, ``n_layers`` pre-norm blocks of (RMSNorm, grouped-query
    attention with rotary embeddings at absolute positions, residual, RMSNorm, SwiGLU MLP,
    residual), a final RMSNorm and an untied LM head (an untied head keeps greedy decoding from
    echoing the current token).

    Every call computes only the tokens that are not cached: the K/V of positions before
    ``cached_len`` are read from the pages, the new tokens' K/V are written into them in place.

    Args:
        cfg: Shape, numerics and seed.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        self.embed = _frozen(
            torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).to(cfg.dtype)
        )
        self.blocks = nn.ModuleList(_Block(cfg, g) for _ in range(cfg.n_layers))
        self.final_norm = _frozen(torch.ones(cfg.hidden_size, dtype=cfg.dtype))
        self.lm_head = _frozen(
            (
                torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
                / math.sqrt(cfg.hidden_size)
            ).to(cfg.dtype)
        )
        half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta**half, persistent=False)
        self.eval()

    # ----------------------------------------------------------------------------- public

    def prefill(
        self,
        tokens: Sequence[int],
        cached_len: int,
        page_table: Sequence[int] | torch.Tensor,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
        layer_wait: LayerWait | None = None,
        return_all_logits: bool = False,
    ) -> torch.Tensor:
        """Run a prompt whose first ``cached_len`` positions already have K/V in the pages.

        Only ``tokens[cached_len:]`` are computed; their K/V are written into the pages and
        they attend causally over all positions ``[0, len(tokens))``.

        Args:
            tokens: The whole prompt, cached prefix included.
            cached_len: Positions ``[0, cached_len)`` hold valid K/V in the pages. kvtier
                caches whole pages, so it passes a multiple of the page size, but any value
                works. Must be ``< len(tokens)``: at least one token is computed, since the
                logits come from it (a fully cached prompt recomputes its last page or token).
            page_table: Page ids of the request, covering at least ``len(tokens)`` positions.
            k_cache: One ``[num_pages, page_size, n_kv_heads, head_dim]`` tensor per layer.
            v_cache: Same shapes as ``k_cache``.
            layer_wait: If given, called as ``layer_wait(i)`` once per layer, in order, after
                layer ``i`` has computed its new queries/keys/values and just before it first
                reads or writes ``k_cache[i]`` / ``v_cache[i]``. A per-layer load of the cached
                prefix completes there, so loading overlaps computing.
            return_all_logits: Return the logits of every new token instead of the last.

        Returns:
            float32 logits: ``[vocab_size]`` for the last token, or
            ``[len(tokens) - cached_len, vocab_size]`` with ``return_all_logits``.

        Raises:
            EngineInputError: Bad tokens, ``cached_len``, page table or cache geometry.
        """
        ids = self._token_tensor(tokens)
        n_total = ids.numel()
        if not 0 <= cached_len < n_total:
            raise EngineInputError(
                f"cached_len must be in [0, len(tokens)={n_total}), got {cached_len}"
            )
        pages, page_size = self._check_cache(page_table, k_cache, v_cache, n_total)
        logits = self._forward(
            ids[cached_len:],
            cached_len,
            pages,
            page_size,
            k_cache,
            v_cache,
            layer_wait,
            return_all_logits,
        )
        return logits if return_all_logits else logits[0]

    def decode(
        self,
        token: int,
        position: int,
        page_table: Sequence[int] | torch.Tensor,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Run one token at ``position``, attending over positions ``[0, position]``.

        Args:
            token: The token id at ``position``.
            position: Its absolute position; ``[0, position)`` must hold valid K/V.
            page_table: Page ids of the request, covering at least ``position + 1`` positions.
            k_cache: One ``[num_pages, page_size, n_kv_heads, head_dim]`` tensor per layer.
            v_cache: Same shapes as ``k_cache``.

        Returns:
            float32 logits ``[vocab_size]`` for the next token.

        Raises:
            EngineInputError: Bad token, position, page table or cache geometry.
        """
        if position < 0:
            raise EngineInputError(f"position must be >= 0, got {position}")
        ids = self._token_tensor([token])
        pages, page_size = self._check_cache(page_table, k_cache, v_cache, position + 1)
        return self._forward(ids, position, pages, page_size, k_cache, v_cache, None, False)[0]

    def generate(
        self,
        tokens: Sequence[int],
        cached_len: int,
        page_table: Sequence[int] | torch.Tensor,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
        max_new_tokens: int,
        layer_wait: LayerWait | None = None,
    ) -> tuple[list[int], torch.Tensor]:
        """Prefill, then decode greedily.

        Args:
            tokens: The whole prompt, cached prefix included.
            cached_len: As for :meth:`prefill`.
            page_table: Page ids of the request. It must cover ``len(tokens) + max_new_tokens
                - 1`` positions (the last generated token is never fed back); covering
                ``len(tokens) + max_new_tokens`` is always enough. Generated tokens' K/V are
                written into these pages.
            k_cache: One ``[num_pages, page_size, n_kv_heads, head_dim]`` tensor per layer.
            v_cache: Same shapes as ``k_cache``.
            max_new_tokens: Number of tokens to generate (>= 0).
            layer_wait: As for :meth:`prefill` (used by the prefill only).

        Returns:
            ``(generated, first_logits)``: the ``max_new_tokens`` generated token ids, and the
            float32 ``[vocab_size]`` logits of the prompt's last token.

        Raises:
            EngineInputError: Bad arguments, or a page table too short for the generation.
        """
        if max_new_tokens < 0:
            raise EngineInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        n_prompt = len(tokens)
        pages, _ = self._check_cache(
            page_table, k_cache, v_cache, n_prompt + max(max_new_tokens - 1, 0)
        )
        first = self.prefill(tokens, cached_len, pages, k_cache, v_cache, layer_wait)
        generated: list[int] = []
        logits = first
        for step in range(max_new_tokens):
            generated.append(int(logits.argmax()))
            if step + 1 < max_new_tokens:
                logits = self.decode(generated[-1], n_prompt + step, pages, k_cache, v_cache)
        return generated, first

    # ---------------------------------------------------------------------------- checks

    def _token_tensor(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise EngineInputError("tokens must not be empty")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise EngineInputError(
                f"token ids must be in [0, {self.cfg.vocab_size}), got range [{lo}, {hi}]"
            )
        return ids

    def _check_cache(
        self,
        page_table: Sequence[int] | torch.Tensor,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
        n_positions: int,
    ) -> tuple[torch.Tensor, int]:
        """Validate the cache geometry and page table; return the table as int64 and page size."""
        cfg = self.cfg
        if len(k_cache) != cfg.n_layers or len(v_cache) != cfg.n_layers:
            raise EngineInputError(
                f"expected {cfg.n_layers} K and V cache tensors, "
                f"got {len(k_cache)} and {len(v_cache)}"
            )
        first = k_cache[0]
        if first.dim() != 4 or tuple(first.shape[2:]) != (cfg.n_kv_heads, cfg.head_dim):
            raise EngineInputError(
                f"KV cache tensors must be [num_pages, page_size, {cfg.n_kv_heads}, "
                f"{cfg.head_dim}], got {list(first.shape)}"
            )
        device = self.embed.device
        for side in (k_cache, v_cache):
            for layer, t in enumerate(side):
                if t.shape != first.shape or t.dtype != cfg.dtype:
                    raise EngineInputError(
                        f"KV cache tensor of layer {layer} is {list(t.shape)} {t.dtype}, "
                        f"expected {list(first.shape)} {cfg.dtype}"
                    )
                if t.device != device:
                    raise EngineInputError(
                        f"KV cache tensor of layer {layer} is on {t.device}, the model on "
                        f"{device}: both must be on one device"
                    )
        num_pages, page_size = int(first.shape[0]), int(first.shape[1])
        pages = torch.as_tensor(page_table, dtype=torch.int64).reshape(-1).cpu()
        needed = -(-n_positions // page_size)
        if pages.numel() < needed:
            raise EngineInputError(
                f"page_table has {pages.numel()} pages of {page_size} tokens, "
                f"{needed} needed for {n_positions} positions"
            )
        pages = pages[:needed]
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= num_pages:
            raise EngineInputError(f"page ids must be in [0, {num_pages}), got range [{lo}, {hi}]")
        return pages, page_size

    # ---------------------------------------------------------------------------- compute

    @torch.no_grad()
    def _forward(
        self,
        ids: torch.Tensor,
        start: int,
        pages: torch.Tensor,
        page_size: int,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
        layer_wait: LayerWait | None,
        all_logits: bool,
    ) -> torch.Tensor:
        """Compute tokens at positions ``[start, start + len(ids))``; return float32 logits."""
        cfg = self.cfg
        n, end = ids.numel(), start + ids.numel()
        n_heads, n_kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_out, kv_out = n_heads * hd, n_kv * hd

        # Inputs are validated on the host; every tensor of the computation lives on the
        # model's device (a GPU, the CPU, or torch's meta device in tests).
        device = self.embed.device
        ids, pages = ids.to(device), pages.to(device)
        positions = torch.arange(start, end, device=device)
        cos, sin = self._rope_tables(positions)
        slot_pages, slot_offsets = pages[positions // page_size], positions % page_size
        masks = offset_masks(start, n, device)

        x = self.embed[ids]
        for i, block in enumerate(self.blocks):
            assert isinstance(block, _Block)
            h = rms_norm(x, block.attn_norm, cfg.norm_eps)
            q, k, v = torch.split(F.linear(h, block.wqkv), [q_out, kv_out, kv_out], dim=-1)
            q = apply_rope(q.view(n, n_heads, hd), cos, sin)
            k = apply_rope(k.view(n, n_kv, hd), cos, sin)
            v = v.view(n, n_kv, hd)

            if layer_wait is not None:
                layer_wait(i)
            kc, vc = k_cache[i], v_cache[i]
            kc.index_put_((slot_pages, slot_offsets), k)
            vc.index_put_((slot_pages, slot_offsets), v)
            if start > 0:
                # One gather per layer: every page the request covers, cut to `end` positions.
                k = kc.index_select(0, pages).flatten(0, 1)[:end]
                v = vc.index_select(0, pages).flatten(0, 1)[:end]

            attn = attention(q, k, v, start, masks)
            x = x + F.linear(attn, block.wo)
            h = rms_norm(x, block.mlp_norm, cfg.norm_eps)
            gate, up = F.linear(h, block.w_gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, block.w_down)

        if not all_logits:
            x = x[-1:]
        return F.linear(rms_norm(x, self.final_norm, cfg.norm_eps), self.lm_head).float()

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape ``[n, 1, head_dim]`` for absolute ``positions`` (angles in float64)."""
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos().to(self.cfg.dtype), angles.sin().to(self.cfg.dtype)


def _main() -> None:
    """Time a no-cache prefill and a decode step of the default model (run by hand)."""
    parser = argparse.ArgumentParser(description="Time the reference model on this machine.")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cfg = ModelConfig.default()
    model = TinyLlama(cfg)
    n, page_size = args.tokens, args.page_size
    num_pages = -(-(n + 1) // page_size)
    k_cache, v_cache = new_kv_cache(cfg, num_pages, page_size)
    page_table = list(range(num_pages))
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    token_list = tokens.tolist()

    def best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    print(f"config: {cfg}")
    print(f"threads: {torch.get_num_threads()}")
    t_prefill = best(lambda: model.prefill(token_list, 0, page_table, k_cache, v_cache))
    print(f"prefill {n} tokens, no cache:   {t_prefill * 1000:8.1f} ms")
    half = (n // 2) // page_size * page_size
    t_half = best(lambda: model.prefill(token_list, half, page_table, k_cache, v_cache))
    print(f"prefill {n} tokens, {half} cached: {t_half * 1000:8.1f} ms")
    t_decode = best(lambda: model.decode(1, n, page_table, k_cache, v_cache))
    print(f"decode one step at position {n}: {t_decode * 1000:8.1f} ms")


if __name__ == "__main__":
    _main()
