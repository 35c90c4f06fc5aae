"""A model's parameter tree by shape: what `Transformer(config).init` builds, without building it.

Checkpoint restores, sharding, the Hugging Face importer and the kv-size planner need the tree's
structure, shapes and dtypes but none of its values; they all take them from `abstract_params`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig
from kvjax.model.transformer import Transformer


def abstract_params(config: ModelConfig) -> Any:
  """The 'params' tree of Transformer(config) as jax.ShapeDtypeStructs; nothing is allocated."""
  tokens = jnp.zeros((1, 1), jnp.int32)  # [B, T]: init's parameter shapes do not depend on them
  return jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0), tokens))["params"]


@functools.cache
def param_count(config: ModelConfig) -> int:
  """Weights of Transformer(config): the one count kvjax has (memory budgets, the planner, reports)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(config)))


def param_signature(params: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """{"layers_0/attn/q/kernel": (shape, dtype name), ...} of a tree of arrays or ShapeDtypeStructs."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return {
    "/".join(str(getattr(k, "key", k)) for k in path): (tuple(x.shape), jnp.dtype(x.dtype).name) for path, x in leaves
  }


def check_params(params: Any, config: ModelConfig, what: str = "params") -> None:
  """Raises ValueError, naming `what` and the first differences, unless `params` has the paths,
  shapes and dtypes of Transformer(config)'s parameters."""
  expected, given = param_signature(abstract_params(config)), param_signature(params)
  if expected != given:
    diffs = [
      f"{k}: expected {expected.get(k)}, got {given.get(k)}"
      for k in sorted(set(expected) | set(given))
      if expected.get(k) != given.get(k)
    ]
    raise ValueError(
      f"{what} do not match the model config: {'; '.join(diffs[:5])}"
      + (f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else "")
    )
