"""The CPU decode-attention kernel over KIVI's 4-bit layout (csrc/kivi_attention.cc): against
float64 NumPy attention over the keys and values the codes, scales and residuals stand for
(ragged rows at and across group edges, GQA, MQA and MHA), reading nothing past a row's
positions; and decoding through a kivi4 cache with the kernels against XLA alone."""

import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import init_params, tiny_config
from kvjax.cache.layouts import kivi
from kvjax.cache.config import CacheConfig
from kvjax.decoding import decode
from kvjax.kernels import attention as attention_kernel
from kvjax.model.backend import XLA

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or shutil.which("g++") is None and shutil.which("c++") is None,
  reason="the kernel is built for the CPU with the system's C++ compiler",
)

G = attention_kernel.KIVI_GROUP


def kivi_storage(batch, kv_heads, groups, head_dim, slots, lengths, seed=0):
  """q [B, 1, N, H], random codes and scales of KIVI's layout, lengths (row b reads positions
  [0, lengths[b]]), and the float64 keys and values [B, K, S, H] they stand for. What a row does
  not hold (scales of groups past it, residual entries past its positions) is NaN."""
  rng = np.random.default_rng(seed)
  lengths = np.asarray(lengths, np.int32)
  q = rng.standard_normal((batch, 1, kv_heads * groups, head_dim)).astype(np.float32)
  codes = {n: rng.integers(0, 16, (batch, kv_heads, slots, head_dim)) for n in "kv"}
  k_scale = np.stack(
    [
      rng.uniform(0.05, 0.3, (batch, kv_heads, slots // G, head_dim)),
      rng.integers(0, 16, (batch, kv_heads, slots // G, head_dim)),
    ],
    axis=3,
  ).astype(np.float32)  # [B, K, S / 32, 2, H]
  v_scale = np.stack(
    [
      rng.uniform(0.05, 0.3, (batch, kv_heads, slots, head_dim // G)),
      rng.integers(0, 16, (batch, kv_heads, slots, head_dim // G)),
    ],
    axis=3,
  ).astype(np.float32)  # [B, K, S, 2, H / 32]
  residual = {n: rng.standard_normal((batch, kv_heads, G, head_dim)).astype(np.float32) for n in "kv"}
  k_group = np.repeat(k_scale.astype(np.float64), G, axis=2)  # [B, K, S, 2, H]
  keys = (codes["k"] - k_group[:, :, :, 1]) * k_group[:, :, :, 0]
  v_group = np.repeat(v_scale.astype(np.float64), G, axis=4)  # [B, K, S, 2, H]
  values = (codes["v"] - v_group[:, :, :, 1]) * v_group[:, :, :, 0]
  for b, n in enumerate(lengths + 1):
    coded = n // G * G
    keys[b, :, coded:n] = residual["k"][b, :, : n - coded]
    values[b, :, coded:n] = residual["v"][b, :, : n - coded]
    k_scale[b, :, -(-n // G) :] = np.nan
    if coded < n:
      k_scale[b, :, coded // G] = np.nan  # the residual's group: its positions are in float
    v_scale[b, :, coded:] = np.nan
    for r in residual.values():
      r[b, :, n - coded :] = np.nan
  packed = {n: (c[..., 0::2] | c[..., 1::2] << 4).astype(np.uint8) for n, c in codes.items()}
  packed["k"] = packed["k"].swapaxes(2, 3)  # keys stored transposed: [B, K, H / 2, S]
  addressing = {"k_scale": k_scale, "v_scale": v_scale, "k_residual": residual["k"], "v_residual": residual["v"]}
  return q, packed["k"], packed["v"], lengths, addressing, (keys, values)


def attention64(q, keys, values, lengths):
  """float64 attention of q [B, 1, N, H] over each row's positions [0, lengths[b]]."""
  b, _, n, h = q.shape
  kv = keys.shape[1]
  out = np.zeros((b, 1, n, h))
  for row in range(b):
    for head in range(n):
      k, v = keys[row, head // (n // kv), : lengths[row] + 1], values[row, head // (n // kv), : lengths[row] + 1]
      s = k @ q[row, 0, head].astype(np.float64) / np.sqrt(h)
      p = np.exp(s - s.max())
      out[row, 0, head] = p @ v / p.sum()
  return out


SHAPES = [
  (4, 2, 4, 64, 96, [0, 31, 32, 95]),  # GQA-4: one position, a residual of 32, one full group, all
  (2, 1, 6, 32, 320, [319, 100]),  # MQA, H = 32 over ten groups
  (3, 3, 1, 64, 64, [40, 63, 7]),  # MHA
]


@pytest.mark.parametrize("batch,kv_heads,groups,head_dim,slots,lengths", SHAPES)
def test_kivi_route_matches_float64_attention(batch, kv_heads, groups, head_dim, slots, lengths):
  q, k, v, lengths, addressing, (keys, values) = kivi_storage(batch, kv_heads, groups, head_dim, slots, lengths)

  xla = functools.partial(kivi.xla_read, bits=4)
  kernel = jax.jit(lambda *a, **kw: attention_kernel.cache_attention(attention_kernel.KIVI_ROUTE, *a, xla, **kw))
  assert re.search(r"@kvjax_kivi_attention\(", kernel.lower(q, k, v, lengths, **addressing).as_text())
  out = np.asarray(kernel(q, k, v, lengths, **addressing))
  assert np.isfinite(out).all()  # nothing read past a row's positions
  want = attention64(q, keys, values, lengths)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  # The XLA form reads the same layout (the NaNs past each row's positions zeroed: it reads them, masked).
  clean = {n: np.nan_to_num(a) for n, a in addressing.items()}
  np.testing.assert_allclose(np.asarray(jax.jit(xla)(q, k, v, lengths, **clean)), want, rtol=2e-5, atol=2e-5)


def test_decode_through_kivi4_matches_kernels_off():
  """Prefill ragged prompts into a kivi4 cache, then decode greedily across group edges: the
  steps with the CPU kernels (decode.decode_step) give the logits of the same steps computed by
  XLA alone (decode.forward on the model without the kernels' backend)."""
  model, params = init_params(tiny_config(2, d_model=64, num_heads=2, max_len=96))  # head_dim 32
  config = CacheConfig(dtype="kivi4")
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (3, 30), 0, model.config.vocab_size), np.int32)
  lengths = np.array([30, 12, 1], np.int32)
  xla_step = jax.jit(decode.forward, static_argnames=("model", "last"))
  ones = jnp.ones((3,), jnp.int32)
  logits_k, cache_k = decode.prefill(model, params, tokens, lengths, 80, logits="last", cache_config=config)
  logits_x, cache_x = decode.prefill(model, params, tokens, lengths, 80, logits="last", cache_config=config)
  lowered = xla_step.lower(decode.for_decoding(model), params, cache_k, jnp.zeros((3, 1), jnp.int32), ones, last=True)
  assert "@kvjax_kivi_attention(" in lowered.as_text() and model.backend is XLA  # the reference is XLA alone
  for _ in range(40):  # every row crosses a group edge
    token = np.asarray(jnp.argmax(logits_x, -1), np.int32)
    logits_k, cache_k = decode.decode_step(model, params, cache_k, token)
    logits_x, cache_x = xla_step(model, params, cache_x, jnp.asarray(token)[:, None], ones, last=True)
    np.testing.assert_allclose(logits_k, logits_x, rtol=1e-4, atol=1e-4)
