"""The CPU small-matmul kernel against numpy, and dot_general's routing to it."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

from kvjax.kernels import matmul

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu" or shutil.which("g++") is None and shutil.which("c++") is None,
  reason="the kernel is built for the CPU with the system's C++ compiler",
)


def reference(x, w):
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def test_kernel_builds():
  # A machine with a compiler must build it: a silent fallback would hide a broken kernel.
  assert matmul.kernel_available()


@pytest.mark.parametrize(
  "m,k,n",
  [(1, 5, 3), (3, 17, 33), (8, 512, 1408), (7, 100, 1000), (16, 64, 50), (2, 512, 16), (5, 40, 15), (16, 1408, 512)],
)
def test_matches_reference(m, k, n):
  # Covers column tiles of every width, the columns past the last full vector and an odd row.
  rng = np.random.default_rng(m * k * n)
  x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
  np.testing.assert_allclose(jax.jit(matmul.small_matmul)(x, w), reference(x, w), rtol=1e-5, atol=1e-5 * k**0.5)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, matmul.MAX_ROWS), k=st.integers(1, 70), n=st.integers(1, 300))
def test_matches_reference_any_shape(m, k, n):
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
  np.testing.assert_allclose(matmul.small_matmul(x, w), reference(x, w), rtol=1e-5, atol=1e-5 * k**0.5)


def test_empty_contraction_gives_zeros():
  np.testing.assert_array_equal(matmul.small_matmul(jnp.ones((4, 0)), jnp.ones((0, 40))), np.zeros((4, 40)))
  dims = (((1,), (0,)), ((), ()))
  np.testing.assert_array_equal(matmul.dot_general(jnp.ones((4, 0)), jnp.ones((0, 40)), dims), np.zeros((4, 40)))


def test_gradients_match_xla():
  rng = np.random.default_rng(1)
  x, w = rng.standard_normal((4, 24), np.float32), rng.standard_normal((24, 40), np.float32)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  ours = jax.grad(loss(matmul.small_matmul), argnums=(0, 1))(x, w)
  theirs = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  dx, dw = rng.standard_normal(x.shape, np.float32), rng.standard_normal(w.shape, np.float32)
  ours = jax.jvp(loss(matmul.small_matmul), (x, w), (dx, dw))
  theirs = jax.jvp(loss(jnp.matmul), (x, w), (dx, dw))
  np.testing.assert_allclose(ours, theirs, rtol=1e-4)


def test_vmap():
  rng = np.random.default_rng(2)
  x, w = rng.standard_normal((3, 2, 16), np.float32), rng.standard_normal((3, 16, 20), np.float32)
  np.testing.assert_allclose(jax.vmap(matmul.small_matmul)(x, w), np.einsum("bmk,bkn->bmn", x, w), rtol=1e-5, atol=1e-5)


def routed(lhs, rhs, dims) -> bool:
  text = jax.jit(lambda a, b: matmul.dot_general(a, b, dims)).lower(lhs, rhs).as_text()
  return matmul.TARGET in text


def test_dot_general_routes_dense_products():
  x = jnp.ones((4, 1, 32), jnp.float32)
  qkv_kernel = jnp.ones((32, 2, 8), jnp.float32)  # DenseGeneral [D, heads, H]
  dims = (((2,), (0,)), ((), ()))
  np.testing.assert_allclose(matmul.dot_general(x, qkv_kernel, dims), lax.dot_general(x, qkv_kernel, dims))
  assert routed(x, qkv_kernel, dims)
  heads = jnp.ones((4, 1, 2, 8), jnp.float32)
  out_kernel = jnp.ones((2, 8, 32), jnp.float32)  # out projection contracts [heads, H]
  out_dims = (((2, 3), (0, 1)), ((), ()))
  np.testing.assert_allclose(
    matmul.dot_general(heads, out_kernel, out_dims), lax.dot_general(heads, out_kernel, out_dims)
  )
  assert routed(heads, out_kernel, out_dims)


def test_dot_general_leaves_other_products_to_xla():
  dims = (((1,), (0,)), ((), ()))
  w = jnp.ones((32, 16), jnp.float32)
  assert not routed(jnp.ones((matmul.MAX_ROWS + 1, 32), jnp.float32), w, dims)  # prefill, training
  assert not routed(jnp.ones((1, 32), jnp.float32), w, dims)  # matrix-vector: XLA is as fast
  assert not routed(jnp.ones((4, 32), jnp.bfloat16), w.astype(jnp.bfloat16), dims)
  assert not routed(jnp.ones((32, 4), jnp.float32), w, (((0,), (0,)), ((), ())))  # not x @ w
