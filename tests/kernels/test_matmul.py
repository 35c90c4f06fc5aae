"""The CPU small-matmul kernel against numpy in every stored weight format, and the routing to it."""

import concurrent.futures
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvjax.kernels import build as cpu_kernels, matmul
from kvjax.model import weights
from kvjax.model.backend import xla_matmul

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
  np.testing.assert_array_equal(matmul.matmul(jnp.ones((4, 0)), jnp.ones((0, 40))), np.zeros((4, 40)))


def test_the_same_bits_however_busy_the_threads_are():
  # The bands' sums are added in a fixed order, so a product does not depend on which thread took
  # which band: four threads calling it at once (the pool's threads wake late and the calling
  # threads take more bands) get the bits it gives alone. Greedy decoding repeats itself.
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((8, 1536), np.float32), rng.standard_normal((1536, 576), np.float32)
  product = jax.jit(matmul.small_matmul)
  alone = np.asarray(product(x, w))
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    busy = list(pool.map(lambda _: np.asarray(product(x, w)), range(200)))
  assert all(np.array_equal(y, alone) for y in busy)


def stored(w, fmt):
  """w float32 [K, N] as kvjax.model.weights stores it, and the float32 matrix it stands for."""
  if fmt == "float32":
    return w, None, w
  if fmt == "bfloat16":
    b = jnp.asarray(w, jnp.bfloat16)
    return b, None, np.asarray(b, np.float32)
  q, scale = weights.quantize_int8(w, (0,))
  return q, scale, q.astype(np.float32) * scale


@pytest.mark.parametrize("fmt", weights.FORMATS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 5, 3), (3, 17, 33), (8, 576, 700), (16, 64, 50), (5, 40, 15), (4, 96, 2000)])
def test_stored_formats_match_their_float32(fmt, transposed, m, k, n):
  # The kernel widens each stored format in registers: the product equals the float32 one of
  # the matrix the stored weights stand for (partial vectors of every width, each row count),
  # and XLA's product of the same stored weights.
  rng = np.random.default_rng(m + k + n)
  x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
  w_stored, scale, w_float = stored(w, fmt)
  if transposed:
    w_stored = w_stored.T.copy() if fmt != "bfloat16" else jnp.asarray(w_stored).T
  ours = jax.jit(functools.partial(matmul.small_matmul, transposed=transposed))(x, jnp.asarray(w_stored), scale)
  if fmt != "float32":  # the stored formats multiply activations rounded to bfloat16
    x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
  np.testing.assert_allclose(ours, reference(x, w_float), rtol=1e-5, atol=1e-5 * k**0.5)
  xla = xla_matmul(jnp.asarray(x), jnp.asarray(w_stored), scale, transposed)
  np.testing.assert_allclose(ours, xla, rtol=1e-5, atol=1e-5 * k**0.5)


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


@pytest.mark.parametrize("transposed", [False, True])
def test_one_row_over_a_large_matrix(transposed):
  # One row times a float32 matrix larger than the caches: shared among the pool's threads or kept
  # on the calling thread (whichever reads faster on this machine), it gives the product.
  rng = np.random.default_rng(3)
  w = rng.standard_normal((4100, 1030), np.float32)  # 16.1 MiB
  x = rng.standard_normal((1, w.shape[1] if transposed else w.shape[0]), np.float32)
  want = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
  np.testing.assert_allclose(matmul.small_matmul(x, w, transposed=transposed), want, rtol=1e-4, atol=1e-3)


def routed(x, w, transposed=False) -> bool:
  text = jax.jit(lambda a, b: matmul.matmul(a, b, None, transposed)).lower(x, w).as_text()
  return matmul.TARGET in text


def test_routing():
  w = jnp.ones((32, 16), jnp.float32)
  assert routed(jnp.ones((4, 32), jnp.float32), w)
  assert routed(jnp.ones((4, 32), jnp.float32), w.T, transposed=True)
  assert not routed(jnp.ones((matmul.MAX_ROWS + 1, 32), jnp.float32), w)  # prefill, training
  # The transposed form (a tied table as the logits projection) leaves more than 8 rows to XLA.
  assert routed(jnp.ones((matmul.MAX_TRANSPOSED_ROWS, 32), jnp.float32), w.T, transposed=True)
  assert not routed(jnp.ones((matmul.MAX_TRANSPOSED_ROWS + 1, 32), jnp.float32), w.T, transposed=True)
  for dtype in (jnp.float32, jnp.bfloat16, jnp.int8):  # one row: a decode step at batch 1
    assert routed(jnp.ones((1, 32), jnp.float32), w.astype(dtype))
  assert not routed(jnp.ones((4, 32), jnp.bfloat16), w.astype(jnp.bfloat16))  # bfloat16 compute


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
@pytest.mark.parametrize("transposed", [False, True])
def test_products_past_the_kernel_match_xla_in_each_stored_format(fmt, transposed):
  # Past the kernel's rows (a prefill), a stored format's product is XLA's; on a CPU without
  # bfloat16 arithmetic it is computed in float32 (`widens`), which must give XLA's bfloat16
  # product up to the order of its float32 sums.
  rng = np.random.default_rng(7)
  m, k, n = matmul.MAX_ROWS + 24, 200, 96
  x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
  w_stored, scale, _ = stored(w, fmt)
  w_stored = jnp.asarray(w_stored)
  if transposed:
    w_stored = w_stored.T
  ours = jax.jit(functools.partial(matmul.matmul, transposed=transposed))(jnp.asarray(x), w_stored, scale)
  np.testing.assert_allclose(
    ours, xla_matmul(jnp.asarray(x), w_stored, scale, transposed), rtol=1e-5, atol=1e-5 * k**0.5
  )
  assert matmul.widens(jnp.float32, w_stored.dtype) == (not cpu_kernels.bfloat16_arithmetic())
