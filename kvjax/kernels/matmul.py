"""Matmuls with few rows on the CPU: the weight products of a decode step.

A decode step multiplies a handful of rows (one per sequence) by every weight matrix, so it is
bound by how fast the weights stream from memory. XLA's CPU dot runs these shapes well below
the machine's bandwidth. The kernel in csrc/small_matmul.cc reads the row-major weights in
order: each thread takes bands of consecutive rows, walks them 8 rows at a time across column
chunks whose slice of y stays in L1, and prefetches the next 8 rows into L2; the threads' sums
are added at the end. Several rows take spans of columns instead, their sums held in registers
over all of w's rows (at 8 rows the stored formats are bound by arithmetic, not by reading w). It
beats XLA's dot on 1 to 16 rows (`kvjax bench matmul`; the figures are in docs/results.md): from
17 rows on, products stay with XLA's blocked GEMM. Weights stored in
bfloat16 or int8 are multiplied by activations rounded to bfloat16 in pairs (vdpbf16ps, where the
CPU has AVX512_BF16): half the multiplies of widening them to float32, which at batch 8 had made
the stored formats as slow as float32.

`matmul` is the CPU backend's product for kvjax's Dense and Embed layers (kvjax.model.weights):
float32 activations times weights stored in float32, bfloat16 or int8 (a scale per output column),
also in the transposed form of a tied embedding table read as the logits projection. It sends
the products `uses_kernel` admits to the kernel when running on a single CPU device, which widens
the stored weights in registers, and everything else to XLA: larger products (prefill and
training, except at toy sizes), accelerators, sharded meshes. Where the CPU has no bfloat16
arithmetic, XLA's products of the stored formats are computed in float32 instead (`widens`): the
same products, faster there. Gradients of float32 products (forward and reverse mode) are XLA's.
The kernel is built on first use (kvjax/kernels/build.py); without a compiler kvjax warns once
and uses XLA. KVJAX_CPU_KERNELS=attention leaves it off (e.g. to compare against XLA's dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import numerics
from kvjax.kernels import build as cpu_kernels

TARGET = "kvjax_small_matmul"
# The rows for which the kernel beats XLA's dot on the development machine (`kvjax bench
# matmul`, see above; one row too, since its matrix-vector product keeps both weights and thread
# pool overhead below XLA's inside a decode step).
MIN_ROWS, MAX_ROWS = 1, 16
# The transposed form (a tied embedding table as the logits projection) sums each output across
# vector lanes; past 8 rows XLA's GEMM is faster on it (Gemma 3's 262,144 x 640 table: 12 rows
# 88 ms against 67, 16 rows 112 against 77; 4 rows 33 against 65).
MAX_TRANSPOSED_ROWS = 8


def kernel_available() -> bool:
  """Whether the CPU kernel is built and registered with XLA (compiling it on first call)."""
  return cpu_kernels.available("matmul")


WEIGHT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)  # the stored formats the kernel reads


def _ffi(x, w, scale, transposed: bool):
  n = w.shape[0] if transposed else w.shape[1]
  out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w, scale, transposed=transposed)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _float_matmul(x, w, transposed: bool):
  return _ffi(x, w, jnp.zeros((0,), jnp.float32), transposed)


@_float_matmul.defjvp
def _float_matmul_jvp(transposed, primals, tangents):
  # The tangent is XLA's (linear, so reverse mode transposes it): the kernel only runs forward.
  (x, w), (dx, dw) = primals, tangents
  w, dw = (w.T, dw.T) if transposed else (w, dw)
  return _float_matmul(*primals, transposed), dx @ w + x @ dw


def small_matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *, transposed: bool = False) -> jax.Array:
  """x float32[M, K] @ w [K, N] (w [N, K] and x @ w.T when `transposed`), times scale float32[N]
  per output column when given -> float32[M, N], by the CPU kernel. w is float32, bfloat16 or
  int8 (kvjax.model.weights' stored formats), widened to float32 as it is read; with a stored
  format the kernel rounds x to bfloat16 first (kvjax.numerics), as XLA's product does.

  Float32 weights without a scale are differentiable (XLA's tangents); the stored formats are
  for decoding only. Under jax.vmap each example is its own kernel call (and reads its weights
  again): fold a batch of examples into the rows instead when they share w.
  """
  if not kernel_available():
    raise RuntimeError("the CPU small-matmul kernel is unavailable; use kvjax.kernels.matmul.matmul")
  k_axis = 1 if transposed else 0
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[k_axis]:
    form = "[N, K]" if transposed else "[K, N]"
    raise ValueError(f"small_matmul expects x [M, K] and w {form}, got {x.shape} and {w.shape}")
  if w.dtype not in WEIGHT_DTYPES:
    raise ValueError(f"small_matmul reads weights in float32, bfloat16 or int8, got {w.dtype}")
  if scale is None and w.dtype == jnp.float32:
    return _float_matmul(x, w, transposed)
  n = w.shape[1 - k_axis]
  scale = jnp.zeros((0,), jnp.float32) if scale is None else scale.reshape(-1).astype(jnp.float32)
  if scale.shape[0] not in (0, n):
    raise ValueError(f"small_matmul takes one scale per output column ({n}), got {scale.shape[0]}")
  return _ffi(x, w, scale, transposed)


def uses_kernel(rows: int, x_dtype, w_dtype=jnp.float32, transposed: bool = False) -> bool:
  """Whether a product of `rows` rows of x_dtype by weights stored as w_dtype goes to the kernel:
  MIN_ROWS to MAX_ROWS rows of float32 activations (MAX_TRANSPOSED_ROWS in the transposed form;
  XLA would also widen a stored matrix whole before its product)."""
  return (
    MIN_ROWS <= rows <= (MAX_TRANSPOSED_ROWS if transposed else MAX_ROWS)
    and x_dtype == jnp.float32
    and w_dtype in WEIGHT_DTYPES
    and cpu_kernels.single_cpu()
    and kernel_available()
  )


def widens(x_dtype, w_dtype) -> bool:
  """Whether a product the kernel does not take (prefill, more rows than MAX_ROWS) of float32
  activations by weights stored in bfloat16 or int8 is computed by XLA in float32, the weights
  widened whole: on a single CPU device without bfloat16 arithmetic, where XLA's bfloat16 product
  is the slower (1,024 rows by SmolLM2's 576 x 1,536 on Zen 3 cores: 11-12 ms against 17-19; 32
  rows 0.8-1.2 ms against 0.9-1.9)."""
  return (
    x_dtype == jnp.float32
    and w_dtype in numerics.STORED_DTYPES
    and cpu_kernels.single_cpu()
    and not cpu_kernels.bfloat16_arithmetic()
  )


def matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, transposed: bool = False) -> jax.Array:
  """kvjax.numerics.matmul's signature, with the products uses_kernel admits computed by
  the CPU kernel (chosen when lowering: a function traced here may still be compiled for an
  accelerator)."""
  xla = functools.partial(numerics.matmul, transposed=transposed)
  if 0 in x.shape or 0 in w.shape:
    return xla(x, w, scale)
  if not uses_kernel(x.shape[0], x.dtype, w.dtype, transposed):
    if not widens(x.dtype, w.dtype):
      return xla(x, w, scale)
    # The same products (two bfloat16 values multiply exactly in float32), summed in float32.
    widened = lambda x, w, scale: xla(numerics.round_to_bfloat16(x), w.astype(jnp.float32), scale)
    return lax.platform_dependent(x, w, scale, cpu=widened, default=xla)
  kernel = lambda x, w, scale: small_matmul(x, w, scale, transposed=transposed)
  return lax.platform_dependent(x, w, scale, cpu=kernel, default=xla)
