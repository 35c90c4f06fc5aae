"""CUR (kvjax.cache.presses.cur): the tokens an evicting cache keeps are those a NumPy reading of
kvpress's CURPress.score ranks best, for every leverage type, in GQA and MQA layers."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.cache.presses import CUR
from kvjax.model.rope import Rope
from oracles import check_kept, kept_by_press


def np_cur(k, v, sinks, leverage, window):
  """kvpress CURPress.score (local approximation) for one row's k, v [K, n, H] -> [K, n]."""
  n = k.shape[1]

  def local(x):
    x = np.pad(x, ((0, 0), (0, -n % window))).reshape(x.shape[0], -1, window)
    return (x / x.sum(-1, keepdims=True)).reshape(x.shape[0], -1)[:, :n]

  k2, v2 = local((k**2).sum(-1)), local((v**2).sum(-1))
  s = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[leverage]
  s = s / s.sum(-1, keepdims=True)
  s[:, :sinks] = 1.0
  return s


@pytest.mark.parametrize("leverage", ["key", "value", "kv_avg", "kv_product"])
@pytest.mark.parametrize("kv_heads, ratio", [(2, 0.5), (1, 0.75)])
def test_cur_keeps_what_kvpress_definition_keeps(leverage, kv_heads, ratio):
  rng = np.random.default_rng(3)
  t, lengths = 37, np.array([37, 22, 9])
  q = rng.normal(size=(3, t, 4, 8)).astype(np.float32)
  k, v = (rng.normal(size=(3, kv_heads, t, 8)).astype(np.float32) for _ in range(2))
  press = CUR(compression_ratio=ratio, sinks=2, leverage=leverage, window=8)
  positions = kept_by_press(press, q, k, v, lengths, Rope(10000.0, 8))
  scores = lambda b, n: np_cur(k[b, :, :n].astype(np.float64), v[b, :, :n].astype(np.float64), 2, leverage, 8)
  check_kept(positions, scores, lengths, ratio)


def test_bad_settings_are_refused_by_name():
  with pytest.raises(ValueError, match="CUR.leverage must be one of"):
    CUR(leverage="both")
  with pytest.raises(ValueError, match="CUR.window"):
    CUR(window=0)
  with pytest.raises(ValueError, match="CUR.sinks"):
    CUR(sinks=-1)
