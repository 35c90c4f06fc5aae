"""ChunkKV (kvjax.cache.presses.chunkkv): the tokens an evicting cache keeps are those a NumPy
reading of kvpress's ChunkKVPress keeps over the same scorer (whole chunks, the same in every
head; a prompt shorter than a chunk by the scorer alone), and the engine's pages refuse it."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.cache import selection
from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import ChunkKV, KNorm, SnapKV
from kvjax.model.rope import Rope
from conftest import tiny_config
from oracles import kept_by_press


def np_chunkkv(scores, ratio, size):
  """kvpress ChunkKVPress.compress over a scorer's scores [K, n] -> the kept positions (sorted)."""
  n = scores.shape[1]
  complete, rest = divmod(n, size)
  if complete == 0:
    return None  # the scorer alone
  total = scores.sum(0)
  chunk = [total[i * size : (i + 1) * size].mean() for i in range(complete)] + ([total[-rest:].mean()] if rest else [])
  keep = max(1, int((complete + (rest > 0)) * (1 - ratio)))
  best = sorted(range(len(chunk)), key=lambda c: (-chunk[c], c))[:keep]
  return sorted(p for c in best for p in range(c * size, min((c + 1) * size, n)))


@pytest.mark.parametrize("kv_heads, ratio", [(2, 0.5), (1, 0.75)])
def test_chunkkv_keeps_what_kvpress_keeps(kv_heads, ratio):
  rng = np.random.default_rng(5)
  t, lengths = 37, np.array([37, 23, 6])  # 6 < one chunk: KNorm alone
  q = rng.normal(size=(3, t, 4, 8)).astype(np.float32)
  k, v = (rng.normal(size=(3, kv_heads, t, 8)).astype(np.float32) for _ in range(2))
  press = ChunkKV(compression_ratio=ratio, scorer=KNorm(), chunk_length=8)
  positions = kept_by_press(press, q, k, v, lengths, Rope(10000.0, 8))
  for b, n in enumerate(lengths):
    knorm = -np.linalg.norm(k[b, :, :n].astype(np.float64), axis=-1)  # [K, n]
    want = np_chunkkv(knorm, ratio, 8)
    for head in range(kv_heads):
      got = sorted(positions[b, head][positions[b, head] >= 0])
      if want is None:
        order = sorted(range(n), key=lambda s: (-knorm[head, s], s))
        assert got == sorted(order[: int(n * (1 - ratio))]), (b, head)
      else:
        assert got == want, (b, head)


def test_what_chunkkv_cannot_take_is_refused_by_name():
  with pytest.raises(
    ValueError,
    match="ChunkKV.scorer=.*must be a layer press that scores tokens one by one, with its budgets at their defaults",
  ):
    ChunkKV(scorer=SnapKV(compression_ratio=0.5))
  with pytest.raises(ValueError, match="leave heads, layers and decode_budget"):
    ChunkKV(heads="adaptive")
  with pytest.raises(ValueError, match="ChunkKV.chunk_length"):
    ChunkKV(chunk_length=0)
  paged = CacheConfig(layout="paged_evict", press=ChunkKV(compression_ratio=0.5))
  with pytest.raises(ValueError, match=r"\(grouped\): layout='paged_evict' cannot hold it"):
    selection.check(tiny_config(2), paged)
