"""Grouped-query attention against a plain per-head reference, the grouping rule, and the payload
each attention module hands its cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.model.attention import NoCache
from kvjax.model.params import abstract_params
from kvjax.model.transformer import cache_payload


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
  np.testing.assert_allclose(
    kvjax.attend(q[:, -1:], k.swapaxes(2, 3), v, mask[:, -1:], k_transposed=True), expected[:, -1:], atol=1e-5
  )


def test_grouping_rule_is_contiguous():
  assert [int(kvjax.kv_head_of(q, 8, 2)) for q in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


class Recording(NoCache):
  """The plain forward's cache kind, recording the shapes of the payload each layer hands it."""

  def __init__(self, batch: int):
    self.lengths, self.handed = jnp.zeros((batch,), jnp.int32), []

  def attend(self, stored, query, q_positions, new, span, backend):
    self.handed.append({name: x.shape for name, x in new.items()})
    return super().attend(stored, query, q_positions, new, span, backend)


@pytest.mark.parametrize(
  "changes", [dict(num_kv_heads=2), dict(num_kv_heads=1, kv_latent_rank=12, rope_dims=4)], ids=["gqa", "mla"]
)
def test_each_layer_hands_its_cache_the_payload_it_declares(changes):
  """What a layer's attention writes to any cache kind is the payload kvjax.model.transformer
  .cache_payload declares (what the caches size their arrays by): [B, heads, T, width] per name."""
  config = kvjax.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=16, **changes)
  recording = Recording(batch=3)
  jax.eval_shape(
    lambda p, t: kvjax.Transformer(config).apply({"params": p}, t, recording),
    abstract_params(config),
    jax.ShapeDtypeStruct((3, 5), jnp.int32),
  )
  want = {name: (3, field.heads, 5, field.width) for name, field in cache_payload(config).items()}
  assert recording.handed == [want] * config.num_layers
  assert sorted(want) == (["latent", "rope_key"] if config.is_latent else ["k", "v"])
