"""LeverageScore and Compactor (kvjax.cache.presses.leverage, compactor): the tokens an evicting
cache keeps are those a NumPy reading of kvpress's LeverageScorePress and CompactorPress ranks
best, given the same sketch: keys turned back from RoPE, the ragged rows' sinks, chunks that end
inside a row and chunks that fill it, in GQA and MQA layers."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.cache.presses import Compactor, LeverageScore
from kvjax.cache.presses.leverage import sketch
from kvjax.model.rope import Rope
from oracles import check_kept, kept_by_press

ROPE = Rope(10000.0, 8)


def np_leverage(k0, phi):
  """kvpress LeverageScorePress.score for one row's keys before RoPE k0 [K, n, H] -> [K, n]."""
  x = (k0 - k0.mean(axis=1, keepdims=True)) @ phi
  gram = np.einsum("kti,ktj->kij", x, x) + 1e-2 * np.eye(phi.shape[1])
  s = np.maximum((x * np.linalg.solve(gram, x.swapaxes(1, 2)).swapaxes(1, 2)).sum(-1), 0)
  return (s - s.mean()) / max(s.std(ddof=1), 1e-6)


def np_noncausal(q, k, v, size):
  """kvpress NonCausalAttnPress.score: q [N, S, H] (rotated), k, v [K, S, H] -> [K, S]."""
  n, s, h = q.shape
  heads = k.shape[0]
  k = np.repeat(k, n // heads, axis=0)
  s_pad = -(-s // size) * size
  qp, kp = (np.concatenate([x, np.zeros((n, s_pad - s, h))], axis=1) for x in (q, k))
  chunks = s_pad // size
  dots = np.einsum("ncih,ncjh->ncij", qp.reshape(n, chunks, size, h), kp.reshape(n, chunks, size, h))
  invalid = np.arange(s_pad - size, s_pad) >= s
  dots[:, -1][:, invalid, :] = 0
  dots[:, -1][:, :, invalid] = -1e-9
  e = np.exp(dots - dots.max(-1, keepdims=True))
  a = (e / e.sum(-1, keepdims=True)).sum(-2).reshape(n, s_pad)[:, :s]
  a = a.reshape(heads, n // heads, s).mean(1) * np.linalg.norm(v, axis=-1)
  a = np.pad(a, ((0, 0), (1, 1)))
  a = (a[:, :-2] + a[:, 1:-1] + a[:, 2:]) / 3
  return (a - a.mean()) / max(a.std(ddof=1), 1e-6)


def np_compactor(q, k, k0, v, phi, start, end, size, blending):
  """kvpress CompactorPress.score for one row: q [N, n, H] rotated, k, v [K, n, H], k0 the keys
  before RoPE -> [K, n]."""
  n = k.shape[1]
  left = min(start, n)
  right = min(end, max(0, n - left))
  mid = slice(left, n - right)
  s = blending * np_leverage(k0[:, mid], phi) + np_noncausal(q[:, mid], k[:, mid], v[:, mid], size)
  return np.concatenate([np.full((k.shape[0], left), s.max()), s, np.full((k.shape[0], right), s.max() + 1)], 1)


def inputs(kv_heads, seed):
  rng = np.random.default_rng(seed)
  t, lengths = 40, np.array([40, 29, 27, 15])  # 27: a middle of 3 whole chunks of 8
  q0 = rng.normal(size=(4, t, 4, 8)).astype(np.float32)
  k0, v = (rng.normal(size=(4, kv_heads, t, 8)).astype(np.float32) for _ in range(2))
  positions = np.broadcast_to(np.arange(t), (4, t))
  q = np.asarray(ROPE.rotate(q0, positions))
  k = np.asarray(ROPE.rotate(k0.swapaxes(1, 2), positions)).swapaxes(1, 2)
  return q, k, k0, v, lengths


@pytest.mark.parametrize("kv_heads, ratio", [(2, 0.5), (1, 0.75)])
def test_leverage_keeps_what_kvpress_definition_keeps_with_the_same_sketch(kv_heads, ratio):
  q, k, k0, v, lengths = inputs(kv_heads, 5)
  press = LeverageScore(compression_ratio=ratio, sketch_dimension=6, seed=3)
  phi = sketch(8, 6, 3).astype(np.float64)
  positions = kept_by_press(press, q, k, v, lengths, ROPE)
  check_kept(positions, lambda b, n: np_leverage(k0[b, :, :n].astype(np.float64), phi), lengths, ratio)


@pytest.mark.parametrize("blending", [None, 2.0])
@pytest.mark.parametrize("kv_heads, ratio", [(2, 0.5), (1, 0.75)])
def test_compactor_keeps_what_kvpress_definition_keeps_with_the_same_sketch(kv_heads, ratio, blending):
  q, k, k0, v, lengths = inputs(kv_heads, 6)
  press = Compactor(
    compression_ratio=ratio, sinks_start=2, sinks_end=1, chunk_size=8, sketch_dimension=6, blending=blending
  )
  phi = sketch(8, 6, 0).astype(np.float64)
  positions = kept_by_press(press, q, k, v, lengths, ROPE)
  weight = ratio if blending is None else blending
  f64 = lambda x, b, n: x[b, :, :n].astype(np.float64)
  scores = lambda b, n: np_compactor(
    f64(q.swapaxes(1, 2), b, n), f64(k, b, n), f64(k0, b, n), f64(v, b, n), phi, 2, 1, 8, weight
  )
  check_kept(positions, scores, lengths, ratio)


def test_a_compactor_scores_each_ratio_apart_unless_its_blending_is_set():
  assert Compactor(compression_ratio=0.5).scoring != Compactor(compression_ratio=0.75).scoring
  assert (
    Compactor(compression_ratio=0.5, blending=1.0).scoring == Compactor(compression_ratio=0.75, blending=1.0).scoring
  )
  assert LeverageScore(compression_ratio=0.5).scoring == LeverageScore(compression_ratio=0.75).scoring


def test_bad_settings_are_refused_by_name():
  with pytest.raises(ValueError, match="LeverageScore.sketch_dimension"):
    LeverageScore(sketch_dimension=0)
  with pytest.raises(ValueError, match="LeverageScore.seed"):
    LeverageScore(seed=-1)
  with pytest.raises(ValueError, match="Compactor.chunk_size"):
    Compactor(chunk_size=0)
  with pytest.raises(ValueError, match="Compactor.sinks_end"):
    Compactor(sinks_end=-2)
  with pytest.raises(ValueError, match="Compactor.blending"):
    Compactor(blending=-1.0)
