"""Float32 matmuls with few rows on the CPU: the weight products of a decode step.

A decode step multiplies a handful of rows (one per sequence) by every weight matrix, so it is
bound by how fast the weights stream from memory. XLA's CPU dot runs these shapes well below
the machine's bandwidth. The kernel in csrc/small_matmul.cc reads the row-major weights in
order: each thread takes bands of consecutive rows, walks them 8 rows at a time across column
chunks whose slice of y stays in L1, and prefetches the next 8 rows into L2; the threads' sums
are added at the end. It beats XLA's dot on 2 to 16 rows (`kvjax bench matmul`; the figures are
in docs/results.md): from 17 rows on, products stay with XLA's blocked GEMM, and so does one row
(a matrix-vector product).

`dot_general` is a drop-in for lax.dot_general that kvjax's Dense layers use: it sends a
float32 product with MIN_ROWS to MAX_ROWS rows to the kernel when running on a single CPU device,
and everything else to XLA: larger products (prefill and training, except at toy sizes),
accelerators, sharded meshes, other dtypes. Gradients (forward and reverse mode) are XLA's.
The kernel is built on first use (kvjax/kernels/build.py); without a compiler kvjax warns once
and uses XLA. KVJAX_CPU_KERNELS=attention leaves it off (e.g. to compare against XLA's dot).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.kernels import build as cpu_kernels

TARGET = "kvjax_small_matmul"
# The rows for which the kernel beats XLA's dot on the development machine (`kvjax bench
# matmul`, see above).
MIN_ROWS, MAX_ROWS = 2, 16


def kernel_available() -> bool:
  """Whether the CPU kernel is built and registered with XLA (compiling it on first call)."""
  return cpu_kernels.available("matmul")


def uses_kernel(rows: int, *dtypes) -> bool:
  """Whether a product with `rows` rows and these operand dtypes goes to the kernel."""
  return (
    MIN_ROWS <= rows <= MAX_ROWS
    and all(d == jnp.float32 for d in dtypes)
    and cpu_kernels.single_cpu()
    and kernel_available()
  )


@jax.custom_jvp
def small_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x float32[M, K] @ w float32[K, N] -> float32[M, N] by the CPU kernel.

  Under jax.vmap each example is its own kernel call (and reads its weights again): fold a
  batch of examples into the rows instead when they share w.
  """
  if not kernel_available():
    raise RuntimeError("the CPU small-matmul kernel is unavailable; use kvjax.kernels.matmul.dot_general")
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"small_matmul expects x [M, K] and w [K, N], got {x.shape} and {w.shape}")
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


@small_matmul.defjvp
def _small_matmul_jvp(primals, tangents):
  # The tangent is XLA's (linear, so reverse mode transposes it): the kernel only runs forward.
  (x, w), (dx, dw) = primals, tangents
  return small_matmul(x, w), dx @ w + x @ dw


def dot_general(
  lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None, preferred_element_type=None
) -> jax.Array:
  """lax.dot_general, with small float32 products that contract lhs's trailing axes against
  rhs's leading axes (every Dense layer's x @ kernel) computed by the CPU kernel."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  n = len(lhs_contract)
  plain = (
    not lhs_batch
    and not rhs_batch
    and 0 < n < lhs.ndim
    and tuple(lhs_contract) == tuple(range(lhs.ndim - n, lhs.ndim))
    and tuple(rhs_contract) == tuple(range(n))
    and preferred_element_type in (None, jnp.float32)
  )
  xla = functools.partial(
    lax.dot_general,
    dimension_numbers=dimension_numbers,
    precision=precision,
    preferred_element_type=preferred_element_type,
  )
  if plain:
    rows, depth = math.prod(lhs.shape[:-n]), math.prod(lhs.shape[-n:])
    if depth > 0 and math.prod(rhs.shape[n:]) > 0 and uses_kernel(rows, lhs.dtype, rhs.dtype):

      def kernel(lhs, rhs):
        out = small_matmul(lhs.reshape(rows, depth), rhs.reshape(depth, -1))
        return out.reshape(*lhs.shape[:-n], *rhs.shape[n:])

      # Chosen when lowering: a function traced here may still be compiled for an accelerator.
      return lax.platform_dependent(lhs, rhs, cpu=kernel, default=xla)
  return xla(lhs, rhs)
