"""Static configuration of a Llama-family decoder."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and numerics of a Llama/Mistral/SmolLM decoder (hashable: used as a static jit arg).

    Attributes:
      vocab_size: rows of the embedding table.
      hidden_size: model width d.
      intermediate_size: SwiGLU width F.
      num_layers: decoder blocks L.
      num_heads: query heads Hq.
      num_kv_heads: key/value heads H (Hq % H == 0; H == Hq is plain multi-head attention).
      head_dim: D, per-head width (usually hidden_size // num_heads).
      rope_theta: RoPE base frequency of the checkpoint.
      rope_factors: None, or per rotary frequency i (head_dim / 2 of them) the divisor of
        theta^(-2i/D): a RoPE scaling rule's result (models/rope.py: linear, llama3, yarn), or
        a GGUF's rope_freqs tensor.
      rope_scale: the factor on RoPE's cos and sin, so on q and k alike (yarn's attention
        factor; 1 otherwise).
      rms_eps: RMSNorm epsilon.
      qkv_bias: the q, k and v projections add a bias (Qwen2; `LayerWeights.b_qkv`).
      qk_norm: each query and key head is RMS-normalized over head_dim (weights
        `LayerWeights.q_norm`, `k_norm`) before RoPE (Qwen3).
      sliding_window: None, or W: each query attends to itself and the W - 1 tokens before it
        (Mistral-7B-v0.1's 4096); the KV state still holds every token (docs/design.md).
      tie_embeddings: the output projection is the transposed embedding table.
      max_context: longest sequence (prompt + generated) the checkpoint was trained for.
      tensor_parallel_axis: None for a model. Set only in the config of one shard under
        `jax.shard_map` (kivi_jax.sharding.shard_config): its heads and MLP width are one
        shard's, and the outputs of the attention's and the MLP's last projections are summed
        over this mesh axis.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_factors: tuple[float, ...] | None = None
    rope_scale: float = 1.0
    rms_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    tie_embeddings: bool = True
    max_context: int = 2048
    tensor_parallel_axis: str | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_context",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                f"LlamaConfig.sliding_window must be None or a positive int, got "
                f"{self.sliding_window!r}"
            )
        factors = self.rope_factors
        if factors is not None and (
            not isinstance(factors, tuple)
            or len(factors) != self.head_dim // 2
            or not all(isinstance(f, float) and f > 0 for f in factors)
        ):
            raise ValueError(
                f"LlamaConfig.rope_factors must be a tuple of head_dim / 2 = {self.head_dim // 2} "
                f"positive floats, got {factors!r:.80}"
            )

    @property
    def num_rep(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads
