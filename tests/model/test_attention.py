"""Grouped-query attention against a plain per-head reference, and the grouping rule."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax


def reference_attention(q, k, v, mask):
  """Plain per-head softmax(q k^T / sqrt(h)) v; query head n reads kv head n // (N // K).

  q [B, T, N, H]; k, v [B, K, S, H]; mask [B, T, S].
  """
  n, kv = q.shape[2], k.shape[1]
  k = np.repeat(np.asarray(k), n // kv, axis=1)  # [B, N, S, H]
  v = np.repeat(np.asarray(v), n // kv, axis=1)
  scores = np.einsum("bthd,bhsd->bhts", q, k) / np.sqrt(q.shape[-1])
  scores = np.where(np.asarray(mask)[:, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bhts,bhsd->bthd", probs, v)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 3), (4, 1)])
def test_attend_matches_reference(num_heads, num_kv_heads):
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 5, num_heads, 8))
  k = jax.random.normal(keys[1], (2, num_kv_heads, 7, 8))
  v = jax.random.normal(keys[2], (2, num_kv_heads, 7, 8))
  mask = np.tril(np.ones((5, 7), bool), k=2)[None].repeat(2, 0)
  expected = reference_attention(q, k, v, mask)
  np.testing.assert_allclose(kvjax.attend(q, k, v, mask), expected, atol=1e-5)
  # The cache's layout (keys [B, K, H, S]), and one query token as in a decode step.
  np.testing.assert_allclose(kvjax.attend(q, k.swapaxes(2, 3), v, mask, k_transposed=True), expected, atol=1e-5)
  np.testing.assert_allclose(kvjax.attend(q[:, -1:], k.swapaxes(2, 3), v, mask[:, -1:], k_transposed=True),
                             expected[:, -1:], atol=1e-5)


def test_grouping_rule_is_contiguous():
  assert [int(kvjax.kv_head_of(q, 8, 2)) for q in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
