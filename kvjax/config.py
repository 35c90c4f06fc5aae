"""Model configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
DTYPES = ("float32", "bfloat16", "float16")


def check_positive(obj: Any, *names: str) -> None:
  """Raises ValueError naming the first field of `obj` that is not a positive int."""
  for name in names:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}")


def check_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
  value = getattr(obj, name)
  if value not in choices:
    raise ValueError(f"{type(obj).__name__}.{name} must be one of {choices}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. MHA when num_kv_heads == num_heads, MQA when it is 1.

  head_dim defaults to d_model // num_heads; mlp_dim to 4 * d_model (GELU) or the
  Llama rule 8/3 * d_model rounded up to a multiple of 64 (SwiGLU). cache_dtype defaults
  to dtype.
  """

  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int | None = None
  mlp_dim: int | None = None
  activation: str = "swiglu"
  norm: str = "rmsnorm"
  norm_eps: float = 1e-6
  positions: str = "rope"
  rope_theta: float = 10_000.0
  qkv_bias: bool = False
  use_bias: bool = False  # biases on the attention output and MLP (GPT-2 style)
  tie_embeddings: bool = False
  max_len: int = 1024
  dtype: str = "float32"
  cache_dtype: str | None = None

  def __post_init__(self):
    check_positive(self, "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "max_len")
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ValueError(
            f"ModelConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
            "set head_dim explicitly")
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    if self.mlp_dim is None:
      default = 4 * self.d_model if self.activation == "gelu" else -(-8 * self.d_model // 3 // 64) * 64
      object.__setattr__(self, "mlp_dim", default)
    if self.cache_dtype is None:
      object.__setattr__(self, "cache_dtype", self.dtype)
    check_positive(self, "head_dim", "mlp_dim")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} is not divisible by "
          f"num_kv_heads={self.num_kv_heads}")
    check_choice(self, "activation", ACTIVATIONS)
    check_choice(self, "norm", NORMS)
    check_choice(self, "positions", POSITIONS)
    check_choice(self, "dtype", DTYPES)
    check_choice(self, "cache_dtype", DTYPES)
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
    if not (isinstance(self.norm_eps, float) and self.norm_eps > 0):
      raise ValueError(f"ModelConfig.norm_eps must be a positive float, got {self.norm_eps!r}")
    if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
      raise ValueError(f"ModelConfig.rope_theta must be positive, got {self.rope_theta!r}")

  @property
  def q_per_kv(self) -> int:
    """G: query heads that share one kv head."""
    return self.num_heads // self.num_kv_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def kv_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.cache_dtype)

  @property
  def kv_bytes_per_token(self) -> int:
    """KV-cache bytes one token occupies: 2 (K and V) x layers x kv heads x head dim x bytes."""
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)
