"""One query token per row against a contiguous cache, in kvjax's CPU kernel (csrc/decode_attention.cc).

The kernel reads only each row's valid positions, where XLA's masked attention reads the whole
buffer. `cache_attention` is the route a decode backend plugs in (kvjax.model.backend): float32
operands on a single CPU device go to the kernel, everything else to the XLA computation it is
given; the choice between the two is made when lowering, so a function traced here may still be
compiled for an accelerator. Gradients are XLA's: the kernel only runs forward.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kvjax.kernels import build

TARGET = build.KERNELS["attention"][0]


def uses_kernel(*dtypes) -> bool:
  """Whether `cache_attention` with operands of these dtypes runs in the CPU kernel."""
  return all(d == jnp.float32 for d in dtypes) and build.single_cpu() and build.available("attention")


def cache_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                    xla: Callable, **addressing) -> jax.Array:
  """q [B, 1, N, H] (rotated), k_cache [B, K, H, S], v_cache [B, K, S, H], lengths int32[B]: row b
  reads positions [0, lengths[b]] -> [B, 1, N, H]. `xla(q, k_cache, v_cache, lengths)` is the
  same computation in XLA."""
  if q.shape[1] != 1:
    raise ValueError(f"cache_attention takes one query token per row, got q of shape {q.shape}")
  if addressing or not uses_kernel(q.dtype, k_cache.dtype, v_cache.dtype):
    return xla(q, k_cache, v_cache, lengths, **addressing)

  @jax.custom_jvp
  def kernel(q, k_cache, v_cache, lengths):
    b, _, n, h = q.shape
    kv = k_cache.shape[1]
    grouped = q.reshape(b, kv, n // kv, h) * (h ** -0.5)  # [B, K, G, H]: query head n reads kv head n // G
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(grouped.shape, q.dtype), vmap_method="sequential")(
        grouped, k_cache, v_cache, lengths.astype(jnp.int32) + 1)
    return out.reshape(b, 1, n, h)

  kernel.defjvp(lambda primals, tangents: (kernel(*primals), jax.jvp(xla, primals, tangents)[1]))
  return jax.lax.platform_dependent(q, k_cache, v_cache, lengths, cpu=kernel, default=xla)
