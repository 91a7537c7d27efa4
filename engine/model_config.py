"""Shape and numerics of the reference model, and a private paged KV cache of its geometry.

:class:`ModelConfig` fixes everything that makes two :class:`~kvtier.engine.model.TinyLlama`
instances compute the same logits (sizes, rotary base, norm epsilon, dtype and the weight seed),
so an engine and a test built from equal configs agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvtier.config.errors import ConfigError

__all__ = ["ModelConfig", "new_kv_cache"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a :class:`TinyLlama`.

    Attributes:
        vocab_size: Number of token ids; valid ids are ``[0, vocab_size)``.
        hidden_size: Width of the residual stream.
        n_layers: Number of decoder layers (and of K/V cache tensors per side).
        n_heads: Query heads per layer.
        n_kv_heads: Key/value heads per layer; divides ``n_heads`` (grouped-query attention).
        head_dim: Width of one head; even (rotary embedding rotates pairs).
        ffn_size: Inner width of the SwiGLU MLP.
        rope_theta: Base of the rotary embedding frequencies.
        norm_eps: Epsilon of RMSNorm.
        seed: Seed of the weight initialisation; equal configs give equal weights.
        dtype: Dtype of weights, activations and the KV cache. Logits are returned as float32.
    """

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        """Check every field.

        Raises:
            ConfigError: a size is not a positive int, ``n_kv_heads`` does not divide
                ``n_heads``, ``head_dim`` is odd, or a numeric setting is out of range.
        """
        for name in (
            "vocab_size",
            "hidden_size",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even, got {self.head_dim}")
        if not self.rope_theta > 1.0:
            raise ConfigError(f"ModelConfig.rope_theta must be > 1, got {self.rope_theta!r}")
        if not self.norm_eps > 0.0:
            raise ConfigError(f"ModelConfig.norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.dtype.is_floating_point:
            raise ConfigError(f"ModelConfig.dtype must be a floating dtype, got {self.dtype}")

    @classmethod
    def default(cls) -> ModelConfig:
        """The reference engine's model: compute-bound enough that KV reuse shows.

        Sized so that a 4096-token prefill with no cache takes on the order of a second on a
        small CPU machine (``python -m kvtier.engine.model`` times it). About half of it is
        attention, the rest projection and MLP matmuls, so compute dominates and a cached
        prefix saves it, as on a GPU. Eight layers give a per-layer load something to overlap
        with.

        Returns:
            8 layers, hidden 256, 4 query heads and 2 KV heads of width 64, SwiGLU 1024,
            vocabulary 8192. K plus V take 8 KiB per token (1 KiB per layer).
        """
        return cls(
            vocab_size=8192,
            hidden_size=256,
            n_layers=8,
            n_heads=4,
            n_kv_heads=2,
            head_dim=64,
            ffn_size=1024,
        )

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A model small enough for fast unit tests.

        Returns:
            2 layers, hidden 64, 4 query heads and 2 KV heads of width 16, vocabulary 256.
        """
        return cls(
            vocab_size=256,
            hidden_size=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            ffn_size=128,
        )

    def kv_page_shape(self, page_size: int) -> tuple[int, int, int]:
        """Shape of one page of one layer's K (or V) cache.

        Args:
            page_size: Tokens per page.

        Returns:
            ``(page_size, n_kv_heads, head_dim)``.
        """
        return (page_size, self.n_kv_heads, self.head_dim)

    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V that one token occupies, over all layers.

        Returns:
            ``2 * n_layers * n_kv_heads * head_dim * itemsize(dtype)``.
        """
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


def new_kv_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, device: torch.device | str = "cpu"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Allocate a zeroed, process-private paged KV cache in the ``layer_first`` layout.

    The engine allocates its cache in shared memory instead; this is for tests and local use.

    Args:
        cfg: The model the cache is for.
        num_pages: Pages per layer.
        page_size: Tokens per page.
        device: Where the cache lives (the model's device).

    Returns:
        ``(k_cache, v_cache)``: one ``[num_pages, page_size, n_kv_heads, head_dim]`` tensor per
        layer on each side.
    """
    shape = (num_pages, *cfg.kv_page_shape(page_size))
    k_cache = [torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(cfg.n_layers)]
    v_cache = [torch.zeros(shape, dtype=cfg.dtype, device=device) for _ in range(cfg.n_layers)]
    return k_cache, v_cache
