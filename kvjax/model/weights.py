"""Weights as stored for decoding: float32 (training's), bfloat16, or int8 with one scale per output channel.

A decode step at small batch reads every weight once per token, so the bytes a weight takes set
the speed: bfloat16 halves them and int8 quarters them. `store(params, "int8")` turns a float32
parameter tree into one of those formats; the model reads whatever format its tree holds, so
prefill, generate, the engine and evaluation take a stored tree as they take a float32 one
(training stays float32). The layers that hold weights are `Dense` and `Embed` here; they hand
the product to the backend (kvjax.model.backend), whose CPU kernel widens bfloat16 and int8 in
registers as it streams them.

Formats, per leaf of a Dense kernel [in..., out...] or an embedding table [rows, D]:
  float32   as trained.
  bfloat16  rounded to bfloat16 (to nearest even).
  int8      round(w / scale) in [-127, 127] with scale = max |w| / 127 taken over the input axes,
            stored beside it as `<name>_scale` [out...] (an embedding table: one per row, which
            serves both the lookup and a tied logits projection).
Biases, norms and MLA's up-projections (k_up, v_up) stay float32.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.model.backend import XLA, Backend

FORMATS = ("float32", "bfloat16", "int8")
SCALE = "_scale"
# Dense layers that contract more than x's last axis: attention's output projection reads
# [..., N, H] (kvjax.model.attention, kvjax.model.mla).
INPUT_AXES = {"out": 2}


def _stored_scale(module: nn.Module, name: str):
  """The int8 scale stored beside param `name`, or None for a float format."""
  return module.get_variable("params", name + SCALE) if module.has_variable("params", name + SCALE) else None


class Dense(nn.Module):
  """y = x @ kernel + bias over x's trailing `axes` axes, the kernel [x.shape[-axes:]..., features...]
  in whatever format it is stored; computed in `dtype` and returned in it."""

  features: int | tuple[int, ...]
  axes: int = 1
  use_bias: bool = False
  dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal()
  backend: Backend = XLA

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    inputs = x.shape[-self.axes :]
    kernel = self.param("kernel", self.kernel_init, inputs + features)
    scale = _stored_scale(self, "kernel")
    flat = x.reshape(-1, math.prod(inputs)).astype(self.dtype)
    y = self.backend.matmul(
      flat, kernel.reshape(math.prod(inputs), -1), None if scale is None else scale.reshape(-1)
    ).astype(self.dtype)
    y = y.reshape(x.shape[: -self.axes] + features)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros_init(), features).astype(self.dtype)
    return y


class Embed(nn.Module):
  """A table [num_embeddings, features] in whatever format it is stored: looked up by id, and
  read as a logits projection by `attend` (tied embeddings)."""

  num_embeddings: int
  features: int
  dtype: Any = jnp.float32
  embedding_init: Callable = nn.initializers.normal(1.0)
  backend: Backend = XLA

  def setup(self):
    self.embedding = self.param("embedding", self.embedding_init, (self.num_embeddings, self.features))
    self.scale = _stored_scale(self, "embedding")

  def __call__(self, ids: jax.Array) -> jax.Array:
    rows = jnp.take(self.embedding, ids, axis=0).astype(self.dtype)
    return rows if self.scale is None else rows * jnp.take(self.scale, ids, axis=0)[..., None].astype(self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """x [..., features] -> [..., num_embeddings]: x times each row."""
    y = self.backend.matmul(x.reshape(-1, self.features).astype(self.dtype), self.embedding, self.scale, True)
    return y.reshape(x.shape[:-1] + (self.num_embeddings,))


def make_norm(cfg: ModelConfig, name: str) -> nn.Module:
  """The model's norm (ModelConfig.norm) over the last axis, its scale (and bias) float32."""
  if cfg.norm == "rmsnorm":
    return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, name=name)
  return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=cfg.compute_dtype, name=name)


def check_format(name: str) -> str:
  if name not in FORMATS:
    raise ValueError(f"weight format {name!r} is not one of {', '.join(FORMATS)}")
  return name


def quantize_int8(w: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """float w -> (int8 round(w / scale), float32 scale = max |w| / 127 over `axes`, those axes dropped)."""
  w = np.asarray(w, np.float32)
  scale = np.abs(w).max(axis=axes, keepdims=True) / 127.0
  scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
  q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
  return q, np.squeeze(scale, axis=axes)


def weight_format(params) -> str:
  """The format a parameter tree is stored in (FORMATS)."""
  dtypes = {np.dtype(leaf.dtype) for leaf in jax.tree_util.tree_leaves(params)}
  return next((name for name in ("int8", "bfloat16") if np.dtype(name) in dtypes), "float32")


def store(params, format: str):
  """A float32 parameter tree stored in `format` (FORMATS): a new tree the model reads as it is.
  Converting a tree already stored in another format is refused: rounding twice loses more."""
  check_format(format)
  current = weight_format(params)
  if current == format:
    return params
  if current != "float32":
    raise ValueError(f"these parameters are stored as {current}; store {format} from the float32 ones")

  def convert(tree: dict, module: str) -> dict:
    out = {}
    for name, value in tree.items():
      if isinstance(value, dict):
        out[name] = convert(value, name)
        continue
      out[name] = value
      table = name == "embedding"
      if not (table or name == "kernel") or np.ndim(value) < 2:
        continue
      if format == "bfloat16":
        out[name] = jnp.asarray(value, jnp.bfloat16)
      else:
        axes = (1,) if table else tuple(range(INPUT_AXES.get(module, 1)))
        q, scale = quantize_int8(np.asarray(value), axes)
        out[name], out[name + SCALE] = jnp.asarray(q), jnp.asarray(scale)
    return out

  return convert(dict(params), "")


def widened(params):
  """The float32 tree a stored one stands for: each stored weight widened, times its scale."""

  def convert(tree: dict) -> dict:
    out = {}
    for name, value in tree.items():
      if isinstance(value, dict):
        out[name] = convert(value)
      elif not name.endswith(SCALE):
        scale = tree.get(name + SCALE)
        value = jnp.asarray(value, jnp.float32)
        if scale is not None:
          axis = value.ndim - scale.ndim
          value = value * (scale[:, None] if name == "embedding" else scale.reshape((1,) * axis + scale.shape))
        out[name] = value
    return out

  return convert(dict(params))


def weight_bytes(params) -> int:
  """Bytes the parameter tree holds, as stored."""
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(params))
