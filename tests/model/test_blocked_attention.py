"""Blocked (flash) attention against attention over the materialised mask: the same outputs for
every query that reads a key, under causal, padded, windowed and sink masks, with keys stored
either way, for ragged tile edges; and the model's long prefill goes through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.model import keys as key_reads
from kvjax.model.keys import Visibility, Window, attend, blocked_attend


def case(seed, b, t, s, n, kv, h, start=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, kv, s, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, kv, s, h)), jnp.float32)
  held = rng.integers(0, s - t + 1, b) if start is None else np.full(b, s - t)
  q_positions = jnp.asarray(held[:, None] + np.arange(t))
  key_positions = jnp.where(jnp.arange(s)[None, :] < held[:, None] + t, jnp.arange(s)[None, :], -1)
  return q, k, v, q_positions, key_positions


@pytest.mark.parametrize(
  "b,t,s,n,kv,h,window,block",
  [
    (2, 37, 37, 4, 2, 8, Window(), 8),  # prefill: causal, ragged tiles
    (1, 40, 40, 3, 1, 16, Window(), 16),
    (2, 24, 61, 6, 3, 8, Window(), 8),  # a chunk after what rows hold
    (2, 50, 50, 4, 4, 8, Window(12, 3), 8),  # sliding window with sinks: tiles skipped below it too
  ],
)
@pytest.mark.parametrize("transposed", [False, True])
def test_blocked_equals_masked(b, t, s, n, kv, h, window, block, transposed):
  q, k, v, qp, kp = case(b * t + s, b, t, s, n, kv, h, start=None if t < s else 0)
  keys = Visibility(qp, kp, window)
  k_in = k.swapaxes(2, 3) if transposed else k
  ours = blocked_attend(q, k_in, v, keys, k_transposed=transposed, block=block)
  theirs = attend(q, k_in, v, keys.mask(), k_transposed=transposed)
  np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=2e-5)


def test_padding_keys_and_rows_without_keys():
  # Keys at negative positions (empty slots, padding) are never read; a query that reads no key
  # at all (a padding column) gives zeros rather than an average of what it may not read.
  q, k, v, qp, kp = case(0, 2, 20, 20, 2, 1, 8)
  kp = kp.at[1, 10:].set(-1)
  qp = qp.at[1, :].set(jnp.where(jnp.arange(20) < 10, jnp.arange(20), -5))
  keys = Visibility(qp, kp, Window())
  ours = blocked_attend(q, k, v, keys, block=8)
  theirs = attend(q, k, v, keys.mask())
  readable = np.asarray(keys.mask().any(-1))
  np.testing.assert_allclose(np.asarray(ours)[readable], np.asarray(theirs)[readable], rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(ours)[~readable], 0)


def test_long_queries_take_the_blocked_path(monkeypatch):
  # attend_keys switches to tiles at 2 * BLOCK queries and keys, and the model's forward over a
  # long prompt (a prefill) then equals the masked computation.
  calls = []
  monkeypatch.setattr(key_reads, "BLOCK", 8)
  original = key_reads.blocked_attend
  monkeypatch.setattr(key_reads, "blocked_attend", lambda *a, **kw: calls.append(1) or original(*a, block=8, **kw))
  q, k, v, qp, kp = case(3, 1, 16, 16, 2, 1, 8)
  keys = Visibility(qp, kp, Window())
  np.testing.assert_allclose(key_reads.attend_keys(q, k, v, keys), attend(q, k, v, keys.mask()), rtol=2e-5, atol=2e-5)
  assert calls
  calls.clear()
  key_reads.attend_keys(q[:, :15], k, v, Visibility(qp[:, :15], kp, Window()))
  assert not calls


def test_gradients_match():
  # Blocked attention is scans and conds: differentiable, as the training path needs.
  q, k, v, qp, kp = case(4, 1, 17, 17, 2, 1, 8)
  keys = Visibility(qp, kp, Window())
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
  ours = jax.grad(loss(lambda q, k, v: blocked_attend(q, k, v, keys, block=8)), argnums=(0, 1, 2))(q, k, v)
  theirs = jax.grad(loss(lambda q, k, v: attend(q, k, v, keys.mask())), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
