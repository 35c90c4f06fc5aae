"""One-token attention over the contiguous cache: the CPU kernel against numpy, its routing and its gradients."""

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvjax.cache.codec import codec
from kvjax.cache.layouts.contiguous import attend_one
from kvjax.kernels import attention as attention_kernel
from kvjax.kernels import build as cpu_kernels
from kvjax.model import keys as key_reads

ROUTE = ("contiguous", "float32")  # ContiguousCache.route of a float32 cache


def attend_cache(q, k, v, lengths, route=ROUTE):
  xla = functools.partial(attend_one, codec=codec(route[1]))
  return attention_kernel.cache_attention(route, q, k, v, lengths, xla)


pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or shutil.which("g++") is None and shutil.which("c++") is None,
  reason="the kernel is built for the CPU with the system's C++ compiler",
)


def reference(q, k, v, lengths):
  """float64 numpy: q [B, 1, N, H], k [B, K, H, S], v [B, K, S, H]; row b reads [0, lengths[b]]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, _, n, h = q.shape
  groups = n // k.shape[1]
  out = np.zeros((b, n, h))
  for row in range(b):
    for head in range(n):
      kv = key_reads.kv_head_of(head, n, k.shape[1])
      keys, values = k[row, kv, :, : lengths[row] + 1], v[row, kv, : lengths[row] + 1]
      scores = q[row, 0, head] @ keys / np.sqrt(h)
      probs = np.exp(scores - scores.max())
      out[row, head] = probs / probs.sum() @ values
  assert groups * k.shape[1] == n
  return out[:, None]


def inputs(batch, kv_heads, groups, head_dim, max_len, lengths, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, 1, kv_heads * groups, head_dim), np.float32)
  k = rng.standard_normal((batch, kv_heads, head_dim, max_len), np.float32)
  v = rng.standard_normal((batch, kv_heads, max_len, head_dim), np.float32)
  return q, k, v, np.asarray(lengths, np.int32)


def test_kernel_builds():
  # A machine with a compiler must build it: a silent fallback would hide a broken kernel.
  assert cpu_kernels.available("attention")


@pytest.mark.parametrize(
  "batch,kv_heads,groups,head_dim,max_len,lengths",
  [
    (2, 2, 4, 64, 256, [0, 255]),  # one position; the whole cache
    (3, 1, 3, 12, 100, [5, 50, 99]),  # head dim and positions not multiples of a vector
    (1, 1, 16, 12, 1000, [999]),  # MQA, one long row: split into chunks and merged
    (2, 2, 5, 130, 40, [17, 39]),  # head dim over one output tile
    (2, 1, 8, 32, 90, [89, 40]),  # GQA-8: a full score tile that reaches past the cache's end
    (2, 1, 1, 7, 3000, [0, 1500]),  # MHA; row 0's chunks past its one position are empty
  ],
)
def test_kernel_matches_reference(batch, kv_heads, groups, head_dim, max_len, lengths):
  q, k, v, lengths = inputs(batch, kv_heads, groups, head_dim, max_len, lengths)
  np.testing.assert_allclose(jax.jit(attend_cache)(q, k, v, lengths), reference(q, k, v, lengths), rtol=1e-5, atol=2e-6)


@settings(max_examples=10, deadline=None)
@given(
  batch=st.integers(1, 4),
  kv_heads=st.integers(1, 3),
  groups=st.integers(1, 17),
  head_dim=st.integers(1, 80),
  max_len=st.integers(1, 600),
  data=st.data(),
)
def test_kernel_matches_reference_any_shape(batch, kv_heads, groups, head_dim, max_len, data):
  lengths = data.draw(st.lists(st.integers(0, max_len - 1), min_size=batch, max_size=batch))
  q, k, v, lengths = inputs(batch, kv_heads, groups, head_dim, max_len, lengths)
  np.testing.assert_allclose(attend_cache(q, k, v, lengths), reference(q, k, v, lengths), rtol=1e-5, atol=2e-6)


def test_kernel_propagates_nan():
  # Like XLA's softmax: a NaN among a row's valid keys makes its output NaN, wherever it falls.
  q, k, v, lengths = inputs(2, 1, 2, 8, 64, [40, 40])
  k[0, 0, 3, 5] = np.nan  # a position in the vectorised part
  k[1, 0, 3, 40] = np.nan  # the last position, past the last full vector
  out = np.asarray(attend_cache(q, k, v, lengths))
  assert np.isnan(out).all()


def test_routing():
  """A float32 cache's route goes to the kernel; operands that are not what the route names (a
  bfloat16 storage under the float32 route, bfloat16 queries) stay with XLA, and give XLA's result."""
  q, k, v, lengths = inputs(2, 2, 2, 8, 32, [3, 31])
  lowered = lambda *a, route=ROUTE: jax.jit(attend_cache, static_argnames="route").lower(*a, route=route).as_text()
  target = attention_kernel.TARGET
  assert target == attention_kernel.TARGETS[ROUTE] and target in lowered(q, k, v, lengths)
  k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  assert "kvjax_" not in lowered(q, k16, v16, lengths)
  np.testing.assert_allclose(
    attend_cache(q, k16, v16, lengths),
    reference(q, k16.astype(np.float32), v16.astype(np.float32), lengths),
    rtol=1e-5,
    atol=2e-6,
  )
  assert "kvjax_" not in lowered(q.astype(jnp.bfloat16), k16, v16, lengths, route=("contiguous", "bfloat16"))
  assert attention_kernel.uses_kernel(jnp.float32, ROUTE)
  assert not attention_kernel.uses_kernel(jnp.bfloat16, ROUTE)
  assert all(
    attention_kernel.uses_kernel(jnp.float32, ("contiguous", name))
    for name in ("bfloat16", "float16", "int4", "float8_e4m3fn")
  )
  assert not attention_kernel.uses_kernel(jnp.float32, ("ring", "float32"))


def test_gradients_are_xla():
  q, k, v, lengths = inputs(2, 2, 2, 8, 32, [3, 31])
  loss = lambda q, k, v: (attend_cache(q, k, v, lengths) ** 2).sum()
  mask = (np.arange(32)[None, :] <= lengths[:, None])[:, None, :]
  xla_loss = lambda q, k, v: (key_reads.attend(q, k, v, mask, k_transposed=True) ** 2).sum()
  for ours, theirs in zip(jax.grad(loss, argnums=(0, 1, 2))(q, k, v), jax.grad(xla_loss, argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
