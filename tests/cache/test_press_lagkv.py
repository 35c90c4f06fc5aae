"""LagKV (kvjax.cache.presses.lagkv): the tokens an evicting cache keeps are those a NumPy reading
of kvpress's LagKVPress.score ranks best: whole partitions scored against the next, the sinks and
the last partitions kept, a prompt too short to lag kept by recency; with and without cross
scoring, in GQA and MQA layers."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.cache.presses import LagKV
from kvjax.model.rope import Rope
from oracles import check_kept, kept_by_press


def np_lagkv(k, v, sinks, lag, cross):
  """kvpress LagKVPress.score for one row's k, v [K, n, H] -> [K, n]."""
  heads, n, h = k.shape
  if n < sinks + 2 * lag:
    s = np.ones((heads, n))
    if n > sinks:
      s[:, sinks:] = np.arange(n - sinks) / (n - sinks)
    return s
  end = sinks + (n - sinks) // lag * lag

  def states(x):
    x = x[:, sinks:end].reshape(heads, -1, lag, h)
    ref, cur = x[:, 1:], x[:, :-1]
    low, high = ref.min(axis=2, keepdims=True), ref.max(axis=2, keepdims=True)
    spread = ((cur - low) / (high - low)).std(axis=-1, ddof=1)
    e = np.exp(spread - spread.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  score = (states(k) + states(v)) / 2
  if not cross:
    score = score.argsort(-1).argsort(-1) / lag
  tail = lag + n - end
  return np.concatenate([np.ones((heads, sinks)), score.reshape(heads, -1), np.ones((heads, tail))], axis=-1)


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("kv_heads, ratio", [(2, 0.5), (1, 0.75)])
def test_lagkv_keeps_what_kvpress_definition_keeps(cross, kv_heads, ratio):
  rng = np.random.default_rng(4)
  t, lengths = 40, np.array([40, 29, 9])  # 9 < 2 sinks + 2 lags: kept by recency
  q = rng.normal(size=(3, t, 4, 8)).astype(np.float32)
  k, v = (rng.normal(size=(3, kv_heads, t, 8)).astype(np.float32) for _ in range(2))
  press = LagKV(compression_ratio=ratio, sinks=2, lag=4, cross_scoring=cross)
  positions = kept_by_press(press, q, k, v, lengths, Rope(10000.0, 8))
  scores = lambda b, n: np_lagkv(k[b, :, :n].astype(np.float64), v[b, :, :n].astype(np.float64), 2, 4, cross)
  check_kept(positions, scores, lengths, ratio)


def test_bad_settings_are_refused_by_name():
  with pytest.raises(ValueError, match="LagKV.lag"):
    LagKV(lag=0)
  with pytest.raises(ValueError, match="LagKV.cross_scoring must be True or False"):
    LagKV(cross_scoring="yes")
