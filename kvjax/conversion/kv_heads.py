"""MHA -> GQA / MQA checkpoint conversion (Ainslie et al. 2023, section 2.1), as a pure function.

The K and V projections of each layer, kernel [D, K, H] and bias [K, H], go from K_old to
K_new heads. Old kv head j joins new head `kv_head_of(j, K_old, K_new)`, that is the
contiguous block j // (K_old / K_new): the same rule by which attention maps query heads to kv
heads, so every query head keeps reading (a pool of) the heads it read before.

  mean:   each new head is the mean of the old heads in its group (the paper's choice).
  first:  each new head is the first old head of its group.
  random: new heads are freshly initialised (the paper's Figure 4 ablation).
These leave Q and output projections and everything else unchanged.
  pca:    data-aware: each group is merged by PCA of its keys (per RoPE frequency pair) and
          values over calibration tokens, and the bases are folded into the query and output
          projections (kvjax.conversion.pca); exact when a group's heads are such transforms
          of one another, which mean-pooling is not.
  regroup: pca after reordering each layer's kv heads (with their query heads and output rows,
          which leaves the model's function unchanged) so that the heads that merge best share
          a group, instead of merging neighbours by index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig
from kvjax.fields import check_positive_int
from kvjax.conversion import pca
from kvjax.model.keys import kv_head_of

METHODS = ("mean", "first", "random", "pca", "regroup")


def _pool(x: jax.Array, groups: np.ndarray, num_new: int, method: str, axis: int) -> jax.Array:
  """Pools axis `axis` of x (the kv-head axis) from len(groups) heads to num_new heads."""
  moved = jnp.moveaxis(x, axis, 0)  # [K_old, ...]
  if method == "mean":
    pooled = jax.ops.segment_sum(moved, groups, num_segments=num_new) / (len(groups) // num_new)
  else:  # first
    first_of_group = np.searchsorted(groups, np.arange(num_new))
    pooled = moved[first_of_group]
  return jnp.moveaxis(pooled.astype(x.dtype), 0, axis)


def _fresh(x: jax.Array, num_new: int, axis: int, key: jax.Array, d_model: int) -> jax.Array:
  shape = list(x.shape)
  shape[axis] = num_new
  if x.ndim == 2:  # bias [K, H]
    return jnp.zeros(shape, x.dtype)
  return (jax.random.normal(key, shape, jnp.float32) * d_model**-0.5).astype(x.dtype)


def check_calibration(tokens, config: ModelConfig, method: str) -> np.ndarray:
  """Calibration tokens int[B, T] as int32, or a ValueError naming what is wrong (missing, not a
  non-empty integer matrix, longer than max_len, an id outside the vocabulary)."""
  if tokens is None:
    raise ValueError(f"method={method!r} needs calibration tokens (int[batch, seq], e.g. training windows)")
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(
      f"calibration must be a non-empty integer array [batch, seq], got {tokens.dtype}{list(tokens.shape)}"
    )
  if tokens.shape[1] > config.max_len:
    raise ValueError(f"calibration windows of {tokens.shape[1]} tokens exceed ModelConfig.max_len={config.max_len}")
  bad = (tokens < 0) | (tokens >= config.vocab_size)
  if bad.any():
    row, pos = map(int, np.argwhere(bad)[0])
    raise ValueError(
      f"calibration token id {int(tokens[row, pos])} at row {row}, position {pos} is outside "
      f"[0, vocab_size={config.vocab_size})"
    )
  return tokens.astype(np.int32)


def convert_kv_heads(
  params, config: ModelConfig, num_kv_heads: int, method: str = "mean", rng: jax.Array | None = None, calibration=None
):
  """Converts a checkpoint to `num_kv_heads` kv heads.

  Args:
    params: the model's 'params' tree (as from Transformer.init or a checkpoint).
    config: the config params belong to.
    num_kv_heads: the target; must divide config.num_kv_heads (MHA -> GQA, MHA -> MQA,
      GQA -> fewer groups).
    method: "mean", "first", "random" (needs rng), "pca" or "regroup" (need calibration).
    calibration: int[B, T] tokens (e.g. windows of the source run's training data) whose
      attention inputs the "pca" method fits its bases to.
  Returns:
    (params, config) for the converted model. The input is not modified.
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  check_positive_int(num_kv_heads, "num_kv_heads")
  if config.num_kv_heads % num_kv_heads:
    raise ValueError(
      f"cannot convert {config.num_kv_heads} kv heads to {num_kv_heads}: the target "
      f"must divide the current number of kv heads ({config.num_kv_heads})"
    )
  if method == "random" and rng is None:
    raise ValueError("method='random' needs an rng key")
  if method in ("pca", "regroup"):
    calibration = check_calibration(calibration, config, method)
  new_config = config.replace(num_kv_heads=num_kv_heads)
  if num_kv_heads == config.num_kv_heads and method != "random":
    return params, new_config
  for i in range(config.num_layers):
    if f"layers_{i}" not in params:
      raise ValueError(f"params have no 'layers_{i}' but config.num_layers={config.num_layers}")
  if method in ("pca", "regroup"):
    inputs = pca.attention_inputs(params, config, calibration)
    new_params = dict(params)
    for i, x in enumerate(inputs):
      attn = params[f"layers_{i}"]["attn"]
      if method == "regroup":
        attn = pca.permute_heads(attn, config, pca.regroup_order(x, attn, config, num_kv_heads))
      attn = pca.convert_layer(attn, x, config, num_kv_heads)
      attn = jax.tree.map(
        lambda new, old: jnp.asarray(new, old.dtype),
        attn,
        {name: {leaf: params[f"layers_{i}"]["attn"][name][leaf] for leaf in attn[name]} for name in attn},
      )
      new_params[f"layers_{i}"] = {**params[f"layers_{i}"], "attn": attn}
    return new_params, new_config

  groups = kv_head_of(np.arange(config.num_kv_heads), config.num_kv_heads, num_kv_heads)
  keys = iter(jax.random.split(rng, 4 * config.num_layers) if rng is not None else [])
  new_params = dict(params)
  for i in range(config.num_layers):
    name = f"layers_{i}"
    if name not in params:
      raise ValueError(f"params have no {name!r} but config.num_layers={config.num_layers}")
    attn = dict(params[name]["attn"])
    for proj in ("k", "v"):
      converted = {}
      for leaf, value in attn[proj].items():
        axis = value.ndim - 2  # kernel [D, K, H] -> 1; bias [K, H] -> 0
        if value.shape[axis] != config.num_kv_heads:
          raise ValueError(
            f"{name}/attn/{proj}/{leaf} has shape {value.shape}, expected {config.num_kv_heads} kv heads on axis {axis}"
          )
        converted[leaf] = (
          _fresh(value, num_kv_heads, axis, next(keys), config.d_model)
          if method == "random"
          else _pool(value, groups, num_kv_heads, method, axis)
        )
      attn[proj] = converted
    new_params[name] = {**params[name], "attn": attn}
  return new_params, new_config
