"""One query token per row against a cache, in kvjax's CPU kernel (csrc/decode_attention.cc).

The kernel reads only each row's valid positions, in place, where XLA's masked attention reads
the whole buffer (and over pages, a gathered copy of it). `cache_attention` is the route a decode
backend plugs in (kvjax.model.backend); the cache kind names its storage by a route
(layout, codec) and passes it as it is, with its addressing arrays:

  route                k_cache, v_cache                                   addressing
  contiguous float32   [B, K, H, S], [B, K, S, H]                          none
  contiguous int8      the same in int8                                    k_scale, v_scale float32[B, K, S]
  paged float32        page pools [K, P, Z, H]                             page_table int32[B, M]
  paged int8           int8 page pools [K, P, Z, H]                        k_scale, v_scale float32[K, P, Z], page_table

(int8: a stored value is int8 * scale, one scale per (position, kv head); the kernel reads the
int8 data, a quarter of float32's bytes.) Float32 queries over these, on a single CPU device, go
to the kernel; everything else (other dtypes, addressing or scale shapes, such as a kind's
grouped scales, accelerators, meshes) to the XLA computation it is given. The choice between the two is made when lowering, so a function traced
here may still be compiled for an accelerator. Gradients are XLA's: the kernel only runs forward.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kvjax.kernels import build

# The cache kinds' routes (layout, codec) -> the kernel's FFI target.
TARGETS = {
  ("contiguous", "float32"): "kvjax_decode_attention",
  ("contiguous", "int8"): "kvjax_decode_attention_int8",
  ("paged", "float32"): "kvjax_paged_attention",
  ("paged", "int8"): "kvjax_paged_attention_int8",
}
TARGET = TARGETS["contiguous", "float32"]
# The kernel addresses a page pool with int32 offsets: pools of this many entries or more stay with XLA.
MAX_POOL_ENTRIES = 2**31 - 4
# The addressing arrays in the kernel's operand order (after q, k_cache, v_cache).
ADDRESSING = ("k_scale", "v_scale", "page_table")


def uses_kernel(compute_dtype, route: tuple[str, str]) -> bool:
  """Whether `cache_attention` of `compute_dtype` queries over a cache kind's `route` (KVCache.route)
  runs in the CPU kernel: float32 queries over a float32 or int8 cache on a single CPU device."""
  return (
    jnp.dtype(compute_dtype) == jnp.float32 and route in TARGETS and build.single_cpu() and build.available("attention")
  )


def kernel_layout(route, q, k_cache, v_cache, addressing: dict) -> tuple[bool, bool] | None:
  """(paged, int8) when `route` is one of the kernel's and the operands are as the module
  docstring says it stores them (names, dtypes and shapes), else None."""
  if route not in TARGETS:
    return None
  paged, int8 = route[0] == "paged", route[1] == "int8"
  want = ({"k_scale", "v_scale"} if int8 else set()) | ({"page_table"} if paged else set())
  if set(addressing) != want:
    return None
  stored = jnp.int8 if int8 else jnp.float32
  if q.dtype != jnp.float32 or k_cache.dtype != stored or v_cache.dtype != stored or q.ndim != 4 or k_cache.ndim != 4:
    return None
  b, _, n, h = q.shape
  if paged:
    kv, pages, size, _ = k_cache.shape
    table = addressing["page_table"]
    if (
      k_cache.shape != (kv, pages, size, h)
      or v_cache.shape != k_cache.shape
      or table.dtype != jnp.int32
      or table.ndim != 2
      or table.shape[0] != b
      or k_cache.size >= MAX_POOL_ENTRIES
    ):
      return None
    scale_shape = (kv, pages, size)
  else:
    kv, s = k_cache.shape[1], k_cache.shape[3]
    if k_cache.shape != (b, kv, h, s) or v_cache.shape != (b, kv, s, h):
      return None
    scale_shape = (b, kv, s)
  if (
    n % kv
    or int8
    and any(
      addressing[name].dtype != jnp.float32 or addressing[name].shape != scale_shape for name in ("k_scale", "v_scale")
    )
  ):
    return None
  return paged, int8


def kernel_target(route, q, k_cache, v_cache, addressing: dict) -> str | None:
  """The kernel's FFI target for these operands, or None where they stay with XLA."""
  if kernel_layout(route, q, k_cache, v_cache, addressing) is None:
    return None
  if not (build.single_cpu() and build.available("attention")):
    return None
  return TARGETS[route]


def cache_attention(
  route: tuple[str, str],
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  lengths: jax.Array,
  xla: Callable,
  **addressing,
) -> jax.Array:
  """q [B, 1, N, H] (rotated), a cache's k_cache and v_cache and its addressing arrays as its
  route (layout, codec) says (module docstring), lengths int32[B]: row b reads positions
  [0, lengths[b]] -> [B, 1, N, H]. `xla(q, k_cache, v_cache, lengths, **addressing)` is the same
  computation in XLA."""
  if q.shape[1] != 1:
    raise ValueError(f"cache_attention takes one query token per row, got q of shape {q.shape}")
  target = kernel_target(route, q, k_cache, v_cache, addressing)
  if target is None:
    return xla(q, k_cache, v_cache, lengths, **addressing)
  names = [n for n in ADDRESSING if n in addressing]
  extra = [addressing[n] for n in names]
  kv_heads = k_cache.shape[0 if "page_table" in addressing else 1]

  def reference(q, k_cache, v_cache, lengths, *extra):
    return xla(q, k_cache, v_cache, lengths, **dict(zip(names, extra)))

  @jax.custom_jvp
  def kernel(q, k_cache, v_cache, lengths, *extra):
    b, _, n, h = q.shape
    grouped = q.reshape(b, kv_heads, n // kv_heads, h) * (h**-0.5)  # [B, K, G, H]: query head n reads kv head n // G
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(grouped.shape, q.dtype), vmap_method="sequential")(
      grouped, k_cache, v_cache, *extra, lengths.astype(jnp.int32) + 1
    )
    return out.reshape(b, 1, n, h)

  kernel.defjvp(lambda primals, tangents: (kernel(*primals), jax.jvp(reference, primals, tangents)[1]))
  return jax.lax.platform_dependent(q, k_cache, v_cache, lengths, *extra, cpu=kernel, default=reference)
