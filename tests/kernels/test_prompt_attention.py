"""A call's queries over its own keys (a prefill) or over a cache's slots in the CPU kernel: against
float64 numpy, the queries that read no key, its routing, its gradients, and a prefill through it."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.kernels import attention as attention_kernel
from kvjax.model.keys import Visibility, Window, attend_keys, visible

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or shutil.which("g++") is None and shutil.which("c++") is None,
  reason="the kernel is built for the CPU with the system's C++ compiler",
)


def operands(batch, t, heads, kv_heads, head_dim, seed=0, shared=False):
  """q [B, T, N, H], k and v [B, K, T, H], the call's positions and each row's valid keys (a
  random length per row; shared: key positions [1, T] with every key valid)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, t, heads, head_dim)).astype(np.float32)
  k, v = (rng.standard_normal((batch, kv_heads, t, head_dim)).astype(np.float32) for _ in range(2))
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (batch, t))
  if shared:
    return q, k, v, positions, np.arange(t, dtype=np.int32)[None]
  lengths = rng.integers(1, t + 1, batch)
  return q, k, v, positions, np.where(np.arange(t)[None] < lengths[:, None], positions, -1).astype(np.int32)


def reference(q, k, v, q_pos, k_pos, window):
  """float64 numpy: query head n reads kv head n // G where `visible` says; zeros where it reads none."""
  mask = np.asarray(visible(jnp.asarray(q_pos), jnp.asarray(k_pos), window))  # [B, T, S]
  mask = np.broadcast_to(mask, (q.shape[0], *mask.shape[1:]))
  groups = q.shape[2] // k.shape[1]
  kk, vv = (np.repeat(np.asarray(a, np.float64), groups, axis=1) for a in (k, v))  # [B, N, S, H]
  scores = np.einsum("btnh,bnsh->bnts", np.asarray(q, np.float64), kk) / np.sqrt(q.shape[3])
  scores = np.where(mask[:, None], scores, -np.inf)
  top = np.max(scores, -1, keepdims=True)
  weights = np.where(mask[:, None], np.exp(scores - np.where(np.isfinite(top), top, 0)), 0.0)
  total = weights.sum(-1, keepdims=True)
  out = np.einsum("bnts,bnsh->btnh", weights / np.where(total > 0, total, 1), vv)
  return out, mask.any(-1)  # [B, T, N, H], whether each query reads a key


def kernel_call(q, k, v, q_pos, k_pos, window):
  keys = Visibility(jnp.asarray(q_pos), jnp.asarray(k_pos), window)
  fn = jax.jit(lambda q, k, v: attention_kernel.prompt_attention(q, k, v, keys, attend_keys))
  return fn, fn.lower(q, k, v).as_text()


@pytest.mark.parametrize(
  "batch,t,heads,kv_heads,head_dim,window,shared",
  [
    (2, 37, 4, 2, 8, Window(), False),  # under one tile of queries, ragged rows
    (3, 300, 6, 2, 16, Window(), False),  # several query and key tiles, GQA-3
    (2, 200, 3, 1, 12, Window(40, 4), False),  # MQA in a window with sinks: tiles skipped behind it
    (2, 150, 4, 4, 64, Window(16), False),  # MHA in a window without sinks
    (1, 129, 2, 1, 4, Window(), True),  # key positions shared by the rows, [1, S]
  ],
)
def test_kernel_matches_float64_and_reads_nothing_where_no_key_is_visible(
  batch, t, heads, kv_heads, head_dim, window, shared
):
  q, k, v, q_pos, k_pos = operands(batch, t, heads, kv_heads, head_dim, shared=shared)
  fn, text = kernel_call(q, k, v, q_pos, k_pos, window)
  assert f"@{attention_kernel.PROMPT_TARGET}(" in text
  out = np.asarray(fn(q, k, v))
  want, reads = reference(q, k, v, q_pos, k_pos, window)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-6)
  assert (out[~reads] == 0).all()
  if window.size and not window.sinks:  # padding queries past their row's keys and window read none
    assert (~reads).any()


def head_reference(q, k, v, q_pos, k_pos, window):
  """float64 numpy for keys of per-kv-head positions k_pos [B, K, S]: query head n reads kv head
  n // G where `visible` says; zeros where it reads none."""
  mask = np.asarray(visible(jnp.asarray(q_pos), jnp.asarray(k_pos), window))  # [B, K, T, S]
  groups = q.shape[2] // k.shape[1]
  mask = np.repeat(mask, groups, axis=1)  # [B, N, T, S]
  kk, vv = (np.repeat(np.asarray(a, np.float64), groups, axis=1) for a in (k, v))  # [B, N, S, H]
  scores = np.einsum("btnh,bnsh->bnts", np.asarray(q, np.float64), kk) / np.sqrt(q.shape[3])
  scores = np.where(mask, scores, -np.inf)
  top = np.max(scores, -1, keepdims=True)
  weights = np.where(mask, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0.0)
  total = weights.sum(-1, keepdims=True)
  return np.einsum("bnts,bnsh->btnh", weights / np.where(total > 0, total, 1), vv)


@pytest.mark.parametrize(
  "kv_heads,window,transposed,per_head",
  [
    (2, Window(), True, False),  # a contiguous cache's slots: keys stored transposed
    (1, Window(24, 2), True, False),  # a ring's slots in a window with sinks
    (2, Window(), True, True),  # an evicting cache: each kv head's own positions, slots out of order
    (3, Window(), False, True),  # per-head positions, keys as [B, K, S, H]
  ],
)
def test_a_call_over_a_cache_s_slots_matches_float64(kv_heads, window, transposed, per_head):
  """Queries of a later call (positions after some the cache holds) over slots holding positions
  in any order, empty slots among them, as a cache read of several tokens gives them."""
  rng = np.random.default_rng(5)
  batch, t, slots, heads, head_dim = 2, 21, 150, 6, 8
  q = rng.standard_normal((batch, t, heads, head_dim)).astype(np.float32)
  k, v = (rng.standard_normal((batch, kv_heads, slots, head_dim)).astype(np.float32) for _ in range(2))
  held = np.array([110, 70])
  q_pos = (held[:, None] + np.arange(t)).astype(np.int32)  # the call's positions after each row's
  shape = (batch, kv_heads, slots) if per_head else (batch, slots)
  k_pos = np.full(shape, -1, np.int32)
  for index in np.ndindex(*shape[:-1]):
    b = index[0]
    kept = np.sort(rng.choice(held[b] + t, size=min(slots - 5, held[b] + t), replace=False))
    k_pos[index][rng.permutation(slots)[: len(kept)]] = kept
  keys = Visibility(jnp.asarray(q_pos), jnp.asarray(k_pos), window)
  operand = k.swapaxes(2, 3) if transposed else k
  fn = jax.jit(lambda q, k, v: attention_kernel.prompt_attention(q, k, v, keys, attend_keys, k_transposed=transposed))
  assert f"@{attention_kernel.PROMPT_TARGET}(" in fn.lower(q, operand, v).as_text()
  want = head_reference(q, k, v, q_pos, k_pos if per_head else np.repeat(k_pos[:, None], kv_heads, 1), window)
  np.testing.assert_allclose(np.asarray(fn(q, operand, v)), want, rtol=1e-5, atol=2e-6)
  xla = attend_keys(q, operand, v, keys, k_transposed=transposed)
  np.testing.assert_allclose(np.asarray(fn(q, operand, v)), np.asarray(xla), rtol=1e-5, atol=2e-6)
  # One query over many slots (a decode step read by positions) would fill one lane of 64: XLA's.
  one = Visibility(jnp.asarray(q_pos[:, :1]), jnp.asarray(k_pos), window)
  step = jax.jit(lambda q, k, v: attention_kernel.prompt_attention(q, k, v, one, attend_keys, k_transposed=transposed))
  assert attention_kernel.PROMPT_TARGET not in step.lower(q[:, :1], operand, v).as_text()


def test_operands_the_kernel_does_not_take_stay_with_xla():
  q, k, v, q_pos, k_pos = operands(2, 40, 4, 2, 8)
  keys = Visibility(jnp.asarray(q_pos), jnp.asarray(k_pos), Window())
  route = lambda q, k, v, transposed=False: attention_kernel.prompt_attention(  # noqa: E731
    q, k, v, keys, attend_keys, k_transposed=transposed
  )
  for args, transposed in [
    ((q[..., :6], k[..., :6], v[..., :6]), False),  # head_dim 6: not a multiple of 4
    ((q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)), False),
  ]:
    lowered = jax.jit(lambda *a: route(*a, transposed=transposed)).lower(*args).as_text()
    assert attention_kernel.PROMPT_TARGET not in lowered
    np.testing.assert_allclose(
      np.asarray(jax.jit(lambda *a: route(*a, transposed=transposed))(*args), np.float32),
      np.asarray(attend_keys(*args, keys, k_transposed=transposed), np.float32),
      rtol=1e-6,
      atol=1e-6,
    )


def test_gradients_are_xlas():
  q, k, v, q_pos, k_pos = operands(1, 70, 2, 1, 8, seed=3)
  keys = Visibility(jnp.asarray(q_pos), jnp.asarray(k_pos), Window())
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, keys)))  # noqa: E731
  kernel = jax.grad(loss(lambda *a: attention_kernel.prompt_attention(*a, attend_keys)), argnums=(0, 1, 2))(q, k, v)
  xla = jax.grad(loss(attend_keys), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(kernel, xla):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
