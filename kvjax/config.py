"""ModelConfig: the network a kvjax model is, and nothing about how it is run.

How its KV cache is stored (layout, codec, pages) is kvjax.cache.config.CacheConfig; the field
checks and the override machinery every config uses are kvjax.fields.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from kvjax.fields import INT32_MAX, check_choice, check_nonnegative, check_positive, check_real, to_dict

ACTIVATIONS = ("swiglu", "gelu", "geglu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
ROPE_SCALINGS = ("llama3",)  # RopeScaling.kind; each one's rule is in kvjax.model.rope.SCALINGS
DTYPES = ("float32", "bfloat16", "float16")
# The furthest position a model whose every layer is windowed may reach: RoPE turns positions
# into float32 angles, which hold integers exactly up to 2**24.
MAX_WINDOWED_POSITIONS = 2**24


def cached_positions(window: int, sinks: int, length: int) -> int:
  """Positions one layer needs to keep for a sequence of `length`: all of them for a global layer
  (window 0), at most window + sinks for a sliding-window layer."""
  return length if window == 0 else min(length, window + sinks)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How a RoPE model rescales its frequencies to reach past the context it was pretrained on.

  kind "llama3" (Llama 3.1 and later): a pair whose wavelength is under original_max_position /
  high_freq_factor keeps its frequency, one over original_max_position / low_freq_factor is
  slowed by `factor`, and those between blend the two (kvjax.model.rope.llama3_scaled). The
  defaults are Llama 3.1's.
  """

  kind: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    check_choice(self, "kind", ROPE_SCALINGS)
    check_real(self, "factor", 1.0, math.inf)
    check_real(self, "low_freq_factor", 0.0, math.inf, open_low=True)
    check_real(self, "high_freq_factor", 0.0, math.inf, open_low=True)
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
      object.__setattr__(self, name, float(getattr(self, name)))  # 8 and 8.0 save alike
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
        f"RopeScaling.high_freq_factor={self.high_freq_factor} must be larger than "
        f"low_freq_factor={self.low_freq_factor} (the blend runs between them)"
      )
    check_positive(self, "original_max_position", most=INT32_MAX)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. MHA when num_kv_heads == num_heads, MQA when it is 1.

  head_dim defaults to d_model // num_heads; mlp_dim to 4 * d_model (GELU) or the
  Llama rule 8/3 * d_model rounded up to a multiple of 64 (SwiGLU, GeGLU). activation "swiglu"
  is silu(gate) * up, "geglu" (Gemma) tanh-gelu(gate) * up, "gelu" tanh-gelu(up) (GPT-2).

  Gemma 3's additions, each off by default: qk_norm normalises every query and key head over
  head_dim (the model's norm, its own scale per projection) before RoPE; post_norms normalises
  the attention output and the MLP output before each residual add (the block then holds four
  norms); scale_embeddings multiplies the embedding lookup by sqrt(d_model), rounded to the
  compute dtype, while a tied logits projection reads the unscaled table; rope_local_theta is the
  RoPE base of the windowed (local) layers, None: rope_theta for every layer.
  rope_scaling (RoPE models only) rescales the rotary frequencies (RopeScaling, Llama 3.1's rule);
  None keeps plain RoPE at base rope_theta.

  Multi-head latent attention (MLA, kvjax.model.mla) when kv_latent_rank r > 0: each token
  caches one latent [r], from which every head's position-free key and value are up-projected,
  and one rotary key [rope_dims] shared by the heads; num_kv_heads then counts the rotary key's
  groups (query head n reads group kv_head_of(n), each rope_dims // num_kv_heads wide, the last
  dims of its head_dim). rope_pairs records, per layer, the source frequency index (in
  [0, head_dim / 2)) of each of the rope_dims / 2 rotary pairs of a converted model; None
  rotates each group as an ordinary RoPE head of its width.

  Sliding windows: `window` is a pattern of per-layer widths repeated over the layers, 0 for a
  global (full-attention) layer: (128, 0) alternates local and global layers as Gemma does,
  (64,) windows every layer, () (the default) keeps every layer global. A query at position t of
  a windowed layer reads key s iff s <= t and (t - s < window or s < sink_tokens): the first
  sink_tokens positions stay visible to every query (StreamingLLM's attention sinks).
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
  window: tuple[int, ...] = ()
  sink_tokens: int = 0
  kv_latent_rank: int = 0
  rope_dims: int = 0
  rope_pairs: tuple[tuple[int, ...], ...] | None = None
  rope_scaling: RopeScaling | None = None
  qk_norm: bool = False
  post_norms: bool = False
  scale_embeddings: bool = False
  rope_local_theta: float | None = None

  def __post_init__(self):
    check_positive(self, "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "max_len", most=INT32_MAX)
    if self.head_dim is None:
      if self.d_model % self.num_heads:
        raise ValueError(
          f"ModelConfig.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; set head_dim explicitly"
        )
      object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
    if self.mlp_dim is None:
      default = 4 * self.d_model if self.activation == "gelu" else -(-8 * self.d_model // 3 // 64) * 64
      object.__setattr__(self, "mlp_dim", default)
    check_positive(self, "head_dim", "mlp_dim", most=INT32_MAX)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}")
    check_choice(self, "activation", ACTIVATIONS)
    check_choice(self, "norm", NORMS)
    check_choice(self, "positions", POSITIONS)
    check_choice(self, "dtype", DTYPES)
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
    if not (isinstance(self.norm_eps, float) and 0 < self.norm_eps < math.inf):
      raise ValueError(f"ModelConfig.norm_eps must be a positive finite float, got {self.norm_eps!r}")
    check_real(self, "rope_theta", 0.0, math.inf, open_low=True, open_high=True)
    if self.rope_scaling is not None:
      if not isinstance(self.rope_scaling, RopeScaling):
        raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
      if self.positions != "rope":
        raise ValueError(
          f"ModelConfig.rope_scaling={self.rope_scaling} rescales RoPE frequencies, but "
          f"positions={self.positions!r}; use rope_scaling=None"
        )
    self._check_window()
    self._check_latent()
    self._check_gemma()

  def _check_gemma(self) -> None:
    for name in ("qk_norm", "post_norms", "scale_embeddings"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"ModelConfig.{name} must be True or False, got {getattr(self, name)!r}")
    if self.qk_norm and self.is_latent:
      raise ValueError(
        f"ModelConfig.qk_norm=True with kv_latent_rank={self.kv_latent_rank}: MLA's absorbed keys have no "
        "per-head key to normalise; use qk_norm=False"
      )
    if self.rope_local_theta is None:
      return
    check_real(self, "rope_local_theta", 0.0, math.inf, open_low=True, open_high=True)
    object.__setattr__(self, "rope_local_theta", float(self.rope_local_theta))
    if self.positions != "rope" or self.is_latent:
      raise ValueError(
        f"ModelConfig.rope_local_theta={self.rope_local_theta} needs RoPE keys and queries (positions='rope', "
        f"no MLA), got positions={self.positions!r}, kv_latent_rank={self.kv_latent_rank}; use None"
      )
    if not any(self.window):
      raise ValueError(
        f"ModelConfig.rope_local_theta={self.rope_local_theta} is the RoPE base of windowed layers, but "
        f"window={self.window} keeps every layer global; use None"
      )

  def _check_window(self):
    if not isinstance(self.window, (tuple, list)):
      raise ValueError(
        f"ModelConfig.window must be a tuple of per-layer window widths (0 = global), got {self.window!r}"
      )
    object.__setattr__(self, "window", tuple(self.window))  # hashable: the config is a jit static
    for i, width in enumerate(self.window):
      if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"ModelConfig.window[{i}] must be a non-negative integer (0 = global), got {width!r}")
      if width > self.max_len:
        raise ValueError(f"ModelConfig.window[{i}]={width} is larger than max_len={self.max_len}")
    check_nonnegative(self, "sink_tokens")
    if self.sink_tokens and not any(self.window):
      raise ValueError(
        f"ModelConfig.sink_tokens={self.sink_tokens} needs a windowed layer, but "
        f"window={self.window} keeps every layer global"
      )
    widest = max(self.window, default=0)
    if self.sink_tokens + widest > self.max_len:
      raise ValueError(
        f"ModelConfig.sink_tokens={self.sink_tokens} + window {widest} is more than max_len={self.max_len}"
      )

  def _check_latent(self) -> None:
    check_nonnegative(self, "kv_latent_rank", "rope_dims", most=INT32_MAX)
    r, d_rope, name = self.kv_latent_rank, self.rope_dims, "ModelConfig"
    if not r:
      if d_rope or self.rope_pairs is not None:
        raise ValueError(f"{name}.rope_dims={d_rope} and rope_pairs need an MLA model (kv_latent_rank > 0)")
      return
    if d_rope and self.positions != "rope":
      raise ValueError(
        f"{name}.rope_dims={d_rope} asks for rotary dims of a model with positions={self.positions!r}; use rope_dims=0"
      )
    if self.positions == "rope" and not d_rope:
      raise ValueError(f"{name}.rope_dims must be positive for an MLA model with RoPE (the shared rotary key)")
    if d_rope % (2 * self.num_kv_heads):
      raise ValueError(
        f"{name}.rope_dims={d_rope} must split into num_kv_heads={self.num_kv_heads} groups "
        "of an even number of dims (rotary pairs)"
      )
    if self.rope_group_dims > self.head_dim:
      raise ValueError(
        f"{name}.rope_dims={d_rope} gives each of the num_kv_heads={self.num_kv_heads} groups "
        f"{self.rope_group_dims} rotary dims, more than head_dim={self.head_dim}"
      )
    spanned = self.num_heads * (2 * self.head_dim - self.rope_group_dims)
    if r > min(self.d_model, spanned):
      raise ValueError(
        f"{name}.kv_latent_rank={r} is larger than possible: the latent projects the d_model="
        f"{self.d_model} input to the position-free keys and values of num_heads x (2 x head_dim - "
        f"rotary dims per group) = {spanned} dims"
      )
    if self.rope_pairs is not None:
      if len(self.rope_pairs) != self.num_layers or any(len(p) != d_rope // 2 for p in self.rope_pairs):
        raise ValueError(
          f"{name}.rope_pairs must hold num_layers={self.num_layers} tuples of rope_dims / 2 = "
          f"{d_rope // 2} frequency indices"
        )
      bad = [i for p in self.rope_pairs for i in p if not 0 <= i < self.head_dim // 2]
      if bad:
        raise ValueError(
          f"{name}.rope_pairs holds frequency index {bad[0]}, outside [0, head_dim / 2 = {self.head_dim // 2})"
        )

  @property
  def q_per_kv(self) -> int:
    """G: query heads that share one kv head."""
    return self.num_heads // self.num_kv_heads

  def layer_window(self, layer: int) -> int:
    """Layer `layer`'s sliding-window width, 0 when it attends globally."""
    return self.window[layer % len(self.window)] if self.window else 0

  def layer_rope_theta(self, layer: int) -> float:
    """Layer `layer`'s RoPE base: rope_local_theta on a windowed layer when it is set, else rope_theta."""
    if self.rope_local_theta is not None and self.layer_window(layer):
      return self.rope_local_theta
    return self.rope_theta

  def cached_positions(self, layer: int, length: int) -> int:
    """Positions layer `layer`'s cache keeps for a sequence of `length` (`cached_positions`)."""
    return cached_positions(self.layer_window(layer), self.sink_tokens, length)

  @property
  def all_windowed(self) -> bool:
    """Every layer is windowed: no layer's cache grows past window + sink_tokens."""
    return all(self.layer_window(i) for i in range(self.num_layers))

  @property
  def max_positions(self) -> int:
    """The longest sequence the model takes: max_len, except for a RoPE model whose every layer
    is windowed (no layer reads further back than its window and sinks, and no table ends at
    max_len), which goes on to MAX_WINDOWED_POSITIONS."""
    return MAX_WINDOWED_POSITIONS if self.all_windowed and self.positions == "rope" else self.max_len

  def check_length(self, length: int, what: str) -> None:
    """Raises ValueError unless a sequence of `length` positions fits the model (`max_positions`).
    `what` is the message's subject, e.g. "row 0 would hold 70 tokens"."""
    if length <= self.max_positions:
      return
    if self.max_positions > self.max_len:
      raise ValueError(
        f"{what}, more than the {self.max_positions} positions a windowed RoPE model's float32 angles hold exactly"
      )
    reason = ""
    if self.all_windowed:
      reason = "; learned positions end at max_len even when every layer is windowed"
    elif any(self.window):
      reason = "; only a model whose every layer is windowed (with RoPE) goes past it"
    raise ValueError(f"{what}, more than ModelConfig.max_len={self.max_len}{reason}")

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def is_latent(self) -> bool:
    """True for multi-head latent attention (kv_latent_rank > 0)."""
    return self.kv_latent_rank > 0

  @property
  def rope_group_dims(self) -> int:
    """MLA: rotary dims each query head reads, rope_dims / num_kv_heads (its head's last dims)."""
    return self.rope_dims // self.num_kv_heads

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return to_dict(self)
