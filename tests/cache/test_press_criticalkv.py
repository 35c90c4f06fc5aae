"""CriticalKV (kvjax.cache.presses.criticalkv): the tokens an evicting cache keeps are those a
NumPy reading of kvpress's CriticalKVPress ranks best: the scorer's first stage kept, the rest by
score times the L1 norm of v W_o over each kv head's query heads, over SnapKV and KNorm, in GQA
and MQA layers; and a layer that hands no output projection is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.cache.presses import CriticalKV, KNorm, SnapKV
from kvjax.model.rope import Rope
from oracles import check_kept, kept_by_press

ROPE = Rope(10000.0, 8)


def np_criticalkv(scores, v, out, ratio, first_stage_ratio=0.5, epsilon=1e-4):
  """kvpress CriticalKVPress.score for one row: scores [K, n] (the scorer's), v [K, n, H], out
  [N, H, D] -> [K, n]."""
  heads, n, _ = v.shape
  budget = max(1, int((1 - ratio) * n * first_stage_ratio))
  first = np.argsort(-scores, axis=-1, kind="stable")[:, :budget]
  groups = out.shape[0] // heads
  image = np.einsum("kth,kghd->kgtd", v, out.reshape(heads, groups, *out.shape[1:]))
  s = (scores + epsilon) * np.abs(image).sum(-1).mean(1)
  np.put_along_axis(s, first, np.finfo(np.float64).max, axis=-1)
  return s


def snapkv_scores(press, q, k, v, lengths):
  """The scorer's own scores of every row (kvjax's, whose agreement with kvpress its own tests
  hold), as NumPy."""
  import jax.numpy as jnp

  return np.asarray(press.prompt_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), ROPE))


@pytest.mark.parametrize("scorer", [SnapKV(window=4), KNorm()], ids=["snapkv", "knorm"])
@pytest.mark.parametrize("kv_heads, ratio", [(2, 0.5), (1, 0.75)])
def test_criticalkv_keeps_what_kvpress_definition_keeps(scorer, kv_heads, ratio):
  rng = np.random.default_rng(7)
  t, lengths = 36, np.array([36, 23, 10])
  q = rng.normal(size=(3, t, 4, 8)).astype(np.float32)
  k, v = (rng.normal(size=(3, kv_heads, t, 8)).astype(np.float32) for _ in range(2))
  out = rng.normal(size=(4, 8, 12)).astype(np.float32)
  press = CriticalKV(compression_ratio=ratio, scorer=scorer)
  positions = kept_by_press(press, q, k, v, lengths, ROPE, out)
  base = snapkv_scores(scorer, q, k, v, lengths).astype(np.float64)
  scores = lambda b, n: np_criticalkv(base[b, :, :n], v[b, :, :n].astype(np.float64), out.astype(np.float64), ratio)
  check_kept(positions, scores, lengths, ratio)


def test_what_criticalkv_cannot_take_is_refused_by_name():
  q = np.zeros((1, 8, 2, 8), np.float32)
  k = v = np.zeros((1, 1, 8, 8), np.float32)
  with pytest.raises(ValueError, match="CriticalKV weighs values by the layer's output projection"):
    kept_by_press(CriticalKV(compression_ratio=0.5), q, k, v, np.array([8]), ROPE)
  with pytest.raises(ValueError, match="CriticalKV.scorer=.*scores tokens one by one"):
    CriticalKV(scorer={"name": "chunkkv"})
  with pytest.raises(ValueError, match="leave heads, layers and decode_budget at their defaults"):
    CriticalKV(heads="adaptive")
  with pytest.raises(ValueError, match="CriticalKV.first_stage_ratio"):
    CriticalKV(first_stage_ratio=1.5)
