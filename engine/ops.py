"""The reference model's tensor operations: RMSNorm, rotary embedding, causal GQA attention.

Pure functions of tensors (no weights, no cache), used by every layer of
:class:`~kvtier.engine.model.TinyLlama`. Attention over a cached prefix needs an explicit
mask (``is_causal`` in SDPA assumes queries and keys start at the same position), so queries are
attended in chunks of :data:`ATTN_CHUNK` tokens: each chunk's mask wastes at most half a chunk
per query instead of half the prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "ATTN_CHUNK",
    "SDPA_HAS_GQA",
    "apply_rope",
    "attention",
    "offset_masks",
    "rms_norm",
    "sdpa",
]

ATTN_CHUNK = 1024
"""Queries are attended in chunks of this many tokens when a cached prefix is present."""

SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
"""Whether ``scaled_dot_product_attention`` takes ``enable_gqa`` (torch 2.5 on)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 and returned in ``x``'s dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def offset_masks(start: int, n: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Boolean masks for queries at ``[start, start + n)`` in chunks of ``ATTN_CHUNK``.

    Chunk ``c`` covers queries ``[s, e)`` (relative to ``start``) and keys ``[0, start + e)``;
    query ``start + j`` may see key ``t`` iff ``t <= start + j``. Empty when no mask is needed
    (no cached prefix, where ``is_causal`` is exact, or a single query, which sees every key).
    The masks are made on ``device``, the device of the attention that uses them.
    """
    if start == 0 or n == 1:
        return []
    masks = []
    for s in range(0, n, ATTN_CHUNK):
        e = min(n, s + ATTN_CHUNK)
        keys = torch.arange(start + e, device=device)
        masks.append(keys[None, :] <= (start + torch.arange(s, e, device=device))[:, None])
    return masks


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, masks: list[torch.Tensor]
) -> torch.Tensor:
    """Causal grouped-query attention of queries ``[start, start+n)`` over keys ``[0, start+n)``.

    Args:
        q: ``[n, n_heads, head_dim]``.
        k: ``[start + n, n_kv_heads, head_dim]``.
        v: Same as ``k``.
        start: Absolute position of the first query.
        masks: From :func:`offset_masks` for ``(start, n)``.

    Returns:
        ``[n, n_heads * head_dim]``.
    """
    n, n_heads, hd = q.shape
    # SDPA wants [batch, heads, tokens, dim]; 4-D inputs take the fast fused CPU kernel.
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.transpose(0, 1).unsqueeze(0)
    v4 = v.transpose(0, 1).unsqueeze(0)
    if not masks:
        out = sdpa(q4, k4, v4, None, is_causal=n > 1)
    else:
        out = torch.empty_like(q4)
        for idx, mask in enumerate(masks):
            s = idx * ATTN_CHUNK
            e = s + mask.shape[0]
            kv_end = mask.shape[1]
            out[:, :, s:e] = sdpa(
                q4[:, :, s:e], k4[:, :, :kv_end], v4[:, :, :kv_end], mask, is_causal=False
            )
    return out.squeeze(0).transpose(0, 1).reshape(n, n_heads * hd)


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor:
    """``scaled_dot_product_attention`` over fewer KV heads than query heads.

    Uses torch's ``enable_gqa`` where it exists (torch 2.5 on); older versions get the KV heads
    repeated to the query heads first, which gives the same result.
    """
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
