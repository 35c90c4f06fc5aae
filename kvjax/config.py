"""Configuration: ModelConfig, the field checks every config uses, and the generic machinery
(apply_overrides, to_dict, from_dict) that works for any nested frozen-dataclass config.

Run configs (kvjax.training.config.TrainRun and the run configs of other jobs) nest these dataclasses
and carry a `job` field naming what `kvjax run` executes.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import types
import typing
from typing import Any, Sequence

import jax.numpy as jnp

# Field metadata: to_dict leaves the field out while it holds its default. For fields added to a
# config after runs were recorded, so that those runs' saved configs (resume checks, workdir
# jobs, fingerprints) still equal the configs that read them.
OMIT_DEFAULT = {"omit_default": True}

ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned")
ROPE_SCALINGS = ("llama3",)  # RopeScaling.kind; each one's rule is in kvjax.model.rope.SCALINGS
DTYPES = ("float32", "bfloat16", "float16")
# Cache storage formats beyond the float dtypes (kvjax.cache.quant): values quantized per token
# and kv head with float32 absmax scales stored beside them.
QUANTIZED_CACHE_DTYPES = ("int8", "int4", "float8_e4m3fn")
CACHE_DTYPES = DTYPES + QUANTIZED_CACHE_DTYPES
INT4_MAX_GROUP = 32
SCALE_BYTES = 4  # float32 scales


def int4_group_size(head_dim: int) -> int:
  """Elements of the head dim that share one int4 scale: the largest even divisor of head_dim
  up to INT4_MAX_GROUP (32 for head_dim 64 or 128; head_dim itself when it is at most 32)."""
  return max(g for g in range(2, min(INT4_MAX_GROUP, head_dim) + 1, 2) if head_dim % g == 0)


def check_cache_dtype(cache_dtype: str, head_dim: int, where: str = "ModelConfig.cache_dtype") -> None:
  """Raises ValueError unless `cache_dtype` is a cache format that fits heads of head_dim."""
  if cache_dtype not in CACHE_DTYPES:
    raise ValueError(f"{where} must be one of {CACHE_DTYPES}, got {cache_dtype!r}")
  if cache_dtype == "int4" and head_dim % 2:
    raise ValueError(f"{where}='int4' packs two values per byte along the head dim, which needs an even "
                     f"head_dim; got head_dim={head_dim}")


def cache_stored_dtype(cache_dtype: str) -> jnp.dtype:
  """The dtype of a cache's K/V arrays: the float dtype, int8, uint8 (int4 packed two per byte) or
  float8_e4m3fn."""
  return jnp.dtype("uint8" if cache_dtype == "int4" else cache_dtype)


def cache_scale_groups(cache_dtype: str, head_dim: int) -> int:
  """float32 scales per token, kv head and K or V: 0 for a float cache, 1 for int8 and fp8
  (absmax over the head dim), head_dim / int4_group_size for int4."""
  if cache_dtype not in QUANTIZED_CACHE_DTYPES:
    return 0
  return head_dim // int4_group_size(head_dim) if cache_dtype == "int4" else 1


def cache_bytes_per_head(cache_dtype: str, head_dim: int) -> int:
  """Exact bytes one token's K (or V) of one kv head occupies in a cache of `cache_dtype`,
  scales included: 4H float32, 2H bfloat16, H + 4 int8 or fp8, H/2 + 4 H/group int4."""
  check_cache_dtype(cache_dtype, head_dim, "cache dtype")
  values = head_dim // 2 if cache_dtype == "int4" else head_dim * cache_stored_dtype(cache_dtype).itemsize
  return values + SCALE_BYTES * cache_scale_groups(cache_dtype, head_dim)


# The furthest position a model whose every layer is windowed may reach: RoPE turns positions
# into float32 angles, which hold integers exactly up to 2**24.
MAX_WINDOWED_POSITIONS = 2**24


def cached_positions(window: int, sinks: int, length: int) -> int:
  """Positions one layer keeps for a sequence of `length`: all of them for a global layer
  (window 0), at most window + sinks for a sliding-window layer."""
  return length if window == 0 else min(length, window + sinks)


def check_positive_int(value: Any, name: str) -> None:
  """Raises ValueError naming `name` unless `value` is an int >= 1 (bools are not ints here)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_positive(obj: Any, *names: str) -> None:
  """Raises ValueError naming the first field of `obj` that is not a positive int."""
  for name in names:
    check_positive_int(getattr(obj, name), f"{type(obj).__name__}.{name}")


def check_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
  value = getattr(obj, name)
  if value not in choices:
    raise ValueError(f"{type(obj).__name__}.{name} must be one of {choices}, got {value!r}")


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
      raise ValueError(f"RopeScaling.high_freq_factor={self.high_freq_factor} must be larger than "
                       f"low_freq_factor={self.low_freq_factor} (the blend runs between them)")
    check_positive(self, "original_max_position")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. MHA when num_kv_heads == num_heads, MQA when it is 1.

  head_dim defaults to d_model // num_heads; mlp_dim to 4 * d_model (GELU) or the
  Llama rule 8/3 * d_model rounded up to a multiple of 64 (SwiGLU). cache_dtype, the KV
  cache's storage format, defaults to dtype; besides the float dtypes it may be "int8", "int4"
  or "float8_e4m3fn" (quantized per token and kv head, kvjax.cache.quant).
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
  An MLA model's layers are all global and its cache float: window must be () and cache_dtype
  one of DTYPES (the latent caches keep no ring and no scales).
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
  # Written out only when set (OMIT_DEFAULT), so the configs recorded before these fields read as before.
  window: tuple[int, ...] = dataclasses.field(default=(), metadata=OMIT_DEFAULT)
  sink_tokens: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
  kv_latent_rank: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
  rope_dims: int = dataclasses.field(default=0, metadata=OMIT_DEFAULT)
  rope_pairs: tuple[tuple[int, ...], ...] | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)
  rope_scaling: RopeScaling | None = dataclasses.field(default=None, metadata=OMIT_DEFAULT)

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
    check_cache_dtype(self.cache_dtype, self.head_dim)
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
    if not (isinstance(self.norm_eps, float) and self.norm_eps > 0):
      raise ValueError(f"ModelConfig.norm_eps must be a positive float, got {self.norm_eps!r}")
    if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
      raise ValueError(f"ModelConfig.rope_theta must be positive, got {self.rope_theta!r}")
    if self.rope_scaling is not None:
      if not isinstance(self.rope_scaling, RopeScaling):
        raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
      if self.positions != "rope":
        raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling} rescales RoPE frequencies, but "
                         f"positions={self.positions!r}; use rope_scaling=None")
    self._check_window()
    self._check_latent()

  def _check_window(self):
    if not isinstance(self.window, (tuple, list)):
      raise ValueError(f"ModelConfig.window must be a tuple of per-layer window widths (0 = global), "
                       f"got {self.window!r}")
    object.__setattr__(self, "window", tuple(self.window))  # hashable: the config is a jit static
    for i, width in enumerate(self.window):
      if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"ModelConfig.window[{i}] must be a non-negative integer (0 = global), got {width!r}")
      if width > self.max_len:
        raise ValueError(f"ModelConfig.window[{i}]={width} is larger than max_len={self.max_len}")
    check_nonnegative(self, "sink_tokens")
    if self.sink_tokens and not any(self.window):
      raise ValueError(f"ModelConfig.sink_tokens={self.sink_tokens} needs a windowed layer, but "
                       f"window={self.window} keeps every layer global")
    widest = max(self.window, default=0)
    if self.sink_tokens + widest > self.max_len:
      raise ValueError(f"ModelConfig.sink_tokens={self.sink_tokens} + window {widest} is more than "
                       f"max_len={self.max_len}")

  def _check_latent(self) -> None:
    check_nonnegative(self, "kv_latent_rank", "rope_dims")
    r, d_rope, name = self.kv_latent_rank, self.rope_dims, "ModelConfig"
    if not r:
      if d_rope or self.rope_pairs is not None:
        raise ValueError(f"{name}.rope_dims={d_rope} and rope_pairs need an MLA model (kv_latent_rank > 0)")
      return
    if self.cache_quantized:
      raise ValueError(f"{name}.cache_dtype={self.cache_dtype!r} asks for a quantized cache of an MLA model "
                       f"(kv_latent_rank={r}); the latent caches store float dtypes only, so use one of {DTYPES}")
    if any(self.window):
      raise ValueError(f"{name}.window={self.window} asks for sliding-window layers in an MLA model "
                       f"(kv_latent_rank={r}); the latent caches keep every position, so use window=()")
    if d_rope and self.positions != "rope":
      raise ValueError(f"{name}.rope_dims={d_rope} asks for rotary dims of a model with positions="
                       f"{self.positions!r}; use rope_dims=0")
    if self.positions == "rope" and not d_rope:
      raise ValueError(f"{name}.rope_dims must be positive for an MLA model with RoPE (the shared rotary key)")
    if d_rope % (2 * self.num_kv_heads):
      raise ValueError(f"{name}.rope_dims={d_rope} must split into num_kv_heads={self.num_kv_heads} groups "
                       "of an even number of dims (rotary pairs)")
    if self.rope_group_dims > self.head_dim:
      raise ValueError(f"{name}.rope_dims={d_rope} gives each of the num_kv_heads={self.num_kv_heads} groups "
                       f"{self.rope_group_dims} rotary dims, more than head_dim={self.head_dim}")
    spanned = self.num_heads * (2 * self.head_dim - self.rope_group_dims)
    if r > min(self.d_model, spanned):
      raise ValueError(f"{name}.kv_latent_rank={r} is larger than possible: the latent projects the d_model="
                       f"{self.d_model} input to the position-free keys and values of num_heads x (2 x head_dim - "
                       f"rotary dims per group) = {spanned} dims")
    if self.rope_pairs is not None:
      if len(self.rope_pairs) != self.num_layers or any(len(p) != d_rope // 2 for p in self.rope_pairs):
        raise ValueError(f"{name}.rope_pairs must hold num_layers={self.num_layers} tuples of rope_dims / 2 = "
                         f"{d_rope // 2} frequency indices")
      bad = [i for p in self.rope_pairs for i in p if not 0 <= i < self.head_dim // 2]
      if bad:
        raise ValueError(f"{name}.rope_pairs holds frequency index {bad[0]}, outside [0, head_dim / 2 = "
                         f"{self.head_dim // 2})")

  @property
  def q_per_kv(self) -> int:
    """G: query heads that share one kv head."""
    return self.num_heads // self.num_kv_heads

  def layer_window(self, layer: int) -> int:
    """Layer `layer`'s sliding-window width, 0 when it attends globally."""
    return self.window[layer % len(self.window)] if self.window else 0

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
      raise ValueError(f"{what}, more than the {self.max_positions} positions a windowed RoPE model's "
                       "float32 angles hold exactly")
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
  def kv_dtype(self) -> jnp.dtype:
    """The dtype of the cache's K/V arrays (`cache_stored_dtype`: uint8 for packed int4)."""
    return cache_stored_dtype(self.cache_dtype)

  @property
  def cache_quantized(self) -> bool:
    return self.cache_dtype in QUANTIZED_CACHE_DTYPES

  @property
  def is_latent(self) -> bool:
    """True for multi-head latent attention (kv_latent_rank > 0)."""
    return self.kv_latent_rank > 0

  @property
  def rope_group_dims(self) -> int:
    """MLA: rotary dims each query head reads, rope_dims / num_kv_heads (its head's last dims)."""
    return self.rope_dims // self.num_kv_heads

  @property
  def kv_bytes_per_token(self) -> int:
    """KV-cache bytes one token occupies: 2 (K and V) x layers x kv heads x the bytes of one
    head's values and scales (`cache_bytes_per_head`); for MLA layers x (kv_latent_rank +
    rope_dims) x bytes, whatever the number of heads."""
    if self.is_latent:
      return self.num_layers * (self.kv_latent_rank + self.rope_dims) * self.kv_dtype.itemsize
    return 2 * self.num_layers * self.num_kv_heads * cache_bytes_per_head(self.cache_dtype, self.head_dim)

  def kv_bytes(self, length: int) -> int:
    """KV-cache bytes one sequence of `length` tokens occupies, each windowed layer keeping at most
    window + sink_tokens positions (kv_bytes_per_token counts every layer at every position),
    scales included (`cache_bytes_per_head`)."""
    per_position = self.kv_bytes_per_token // self.num_layers
    return per_position * sum(self.cached_positions(i, length) for i in range(self.num_layers))

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    return to_dict(self)


def check_nonnegative(obj: Any, *names: str) -> None:
  """Raises ValueError naming the first field of `obj` that is not an int >= 0."""
  for name in names:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{type(obj).__name__}.{name} must be a non-negative integer, got {value!r}")


def check_real(obj: Any, name: str, low: float, high: float, *, open_low: bool = False,
               open_high: bool = False) -> None:
  """Raises ValueError unless field `name` is a real number in [low, high] (ends optionally open)."""
  value = getattr(obj, name)
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  ok = ok and (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
  if not ok:
    interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    raise ValueError(f"{type(obj).__name__}.{name} must be a finite number in {interval}, got {value!r}")


# Generic machinery for any nested frozen-dataclass config (TrainRun and other jobs' run configs).

def to_dict(config: Any) -> dict:
  """Nested dataclass -> dict of JSON types (tuples become lists); OMIT_DEFAULT fields only when set."""
  def plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
              if not (f.metadata.get("omit_default") and getattr(value, f.name) == f.default)}
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [plain(v) for v in value]
    return value
  return plain(config)


def from_dict(cls: type, data: dict) -> Any:
  """Inverse of to_dict: builds `cls` (nested dataclasses, tuples) and so re-runs validation.
  Missing keys take their defaults; unknown keys raise ValueError."""
  if not isinstance(data, dict):
    raise ValueError(f"{cls.__name__} expects a dict, got {data!r}")
  names = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(set(data) - set(names))
  if unknown:
    raise ValueError(f"unknown {cls.__name__} keys {unknown}; valid keys: {', '.join(names)}")
  hints = typing.get_type_hints(cls)
  return cls(**{k: _coerce(hints[k], v, f"{cls.__name__}.{k}") for k, v in data.items()})


def config_keys(config: Any, prefix: str = "") -> list[str]:
  """Dotted names of every leaf field, e.g. ['job', 'model.d_model', ...]."""
  keys = []
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if dataclasses.is_dataclass(value):
      keys += config_keys(value, f"{prefix}{f.name}.")
    elif f.init:
      keys.append(f"{prefix}{f.name}")
  return keys


def apply_overrides(config: Any, overrides: Sequence[str]) -> Any:
  """Applies "section.field=value" strings to a nested frozen dataclass, re-validating each level.

  Values are Python literals (ast.literal_eval); anything that does not parse is taken as a
  string, so `data.source=/tmp/a.txt` works. Fields left at a default derived in __post_init__
  (None resolved there, such as ModelConfig.head_dim) are derived again from the new values.
  Raises ValueError on a malformed item, an unknown key (listing the valid ones) or a wrong type.
  """
  for item in overrides:
    key, sep, text = item.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key:
      raise ValueError(f"override {item!r} is not of the form key=value")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    try:
      config = _replace_path(config, key.split("."), value, key)
    except KeyError:
      raise ValueError(f"unknown config key {key!r}; valid keys: {', '.join(config_keys(config))}") from None
  return config


def _replace_path(obj: Any, parts: list[str], value: Any, key: str) -> Any:
  fields = {f.name: f for f in dataclasses.fields(obj) if f.init}
  if parts[0] not in fields:
    raise KeyError(key)
  current = getattr(obj, parts[0])
  if len(parts) > 1:
    if not dataclasses.is_dataclass(current):
      raise KeyError(key)
    new = _replace_path(current, parts[1:], value, key)
  elif dataclasses.is_dataclass(current):
    raise KeyError(key)
  else:
    new = _coerce(typing.get_type_hints(type(obj))[parts[0]], value, key)
  return _rebuild(obj, parts[0], new)


def _rebuild(obj: Any, name: str, value: Any) -> Any:
  kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
  for f in dataclasses.fields(obj):
    if f.init and f.default is None and f.name != name:
      try:
        derived = getattr(dataclasses.replace(obj, **{f.name: None}), f.name)
      except ValueError:
        continue
      if derived == kwargs[f.name]:
        kwargs[f.name] = None
  kwargs[name] = value
  return type(obj)(**kwargs)


def _type_name(tp: Any) -> str:
  return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
  """Checks `value` against annotation `tp`; returns it converted (int -> float, list -> tuple,
  dict -> dataclass). Raises ValueError naming `where`."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if tp is Any:
    return value
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    for arg in args:
      if arg is not type(None):
        try:
          return _coerce(arg, value, where)
        except ValueError:
          pass
  elif origin is typing.Literal:
    if value in args:
      return value
  elif dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if isinstance(value, dict):
      return from_dict(tp, value)
  elif origin in (tuple, list) and isinstance(value, (list, tuple)):
    if origin is tuple and args and args[-1] is not Ellipsis:
      if len(args) == len(value):
        return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    else:
      items = [_coerce(args[0], v, f"{where}[{i}]") if args else v for i, v in enumerate(value)]
      return tuple(items) if origin is tuple else items
  elif origin is dict:
    if isinstance(value, dict):
      return value
  elif tp is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif isinstance(tp, type) and isinstance(value, tp):
    return value
  raise ValueError(f"{where} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")
