"""One query token per row against a cache, in kvjax's CPU kernel (csrc/decode_attention.cc).

The kernel reads only each row's valid positions, in place, where XLA's masked attention reads
the whole buffer (and over pages, a gathered copy of it). `cache_attention` is the route a decode
backend plugs in (kvjax.model.backend); it takes a cache kind's storage as it is, by the keyword
arrays the kind passes (its addressing):

  storage              k_cache, v_cache                                   addressing
  contiguous float32   [B, K, H, S], [B, K, S, H]                          none
  contiguous int8      the same in int8                                    k_scale, v_scale float32[B, K, S]
  paged float32        page pools [K, P, Z, H]                             page_table int32[B, M]
  paged int8           int8 page pools [K, P, Z, H]                        k_scale, v_scale float32[K, P, Z], page_table

(int8: a stored value is int8 * scale, one scale per (position, kv head); the kernel reads the
int8 data, a quarter of float32's bytes.) Float32 queries over these, on a single CPU device, go
to the kernel; everything else (other dtypes or addressing, accelerators, meshes) to the XLA
computation it is given. The choice between the two is made when lowering, so a function traced
here may still be compiled for an accelerator. Gradients are XLA's: the kernel only runs forward.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kvjax.kernels import build

# (paged, int8) -> the kernel's FFI target.
TARGETS = {(False, False): "kvjax_decode_attention", (False, True): "kvjax_decode_attention_int8",
           (True, False): "kvjax_paged_attention", (True, True): "kvjax_paged_attention_int8"}
TARGET = TARGETS[False, False]
# The kernel addresses a page pool with int32 offsets: larger pools stay with XLA.
MAX_POOL_ENTRIES = 2 ** 31 - 4
# The addressing arrays in the kernel's operand order (after q, k_cache, v_cache).
ADDRESSING = ("k_scale", "v_scale", "page_table")


def uses_kernel(*dtypes) -> bool:
  """Whether `cache_attention` over a float32 cache with operands of these dtypes runs in the CPU kernel."""
  return all(d == jnp.float32 for d in dtypes) and build.single_cpu() and build.available("attention")


def check_addressing(q, k_cache, v_cache, addressing: dict) -> None:
  """Raises ValueError, naming the array, unless the addressing arrays fit the cache's shapes
  (see the module docstring)."""
  if unknown := set(addressing) - set(ADDRESSING):
    raise ValueError(f"cache_attention takes the addressing arrays {ADDRESSING}, got {sorted(unknown)}")
  if ("k_scale" in addressing) != ("v_scale" in addressing):
    raise ValueError("an int8 cache needs both k_scale and v_scale")
  paged = "page_table" in addressing
  if paged:
    table = addressing["page_table"]
    if table.ndim != 2 or table.shape[0] != q.shape[0]:
      raise ValueError(f"page_table must be [B, M] with B={q.shape[0]} rows, got shape {table.shape}")
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != q.shape[3]:
      raise ValueError(f"paged k_cache and v_cache must both be [K, P, Z, H] with H={q.shape[3]}, "
                       f"got {k_cache.shape} and {v_cache.shape}")
  for name, data in (("k_scale", k_cache), ("v_scale", v_cache)):
    if name in addressing:
      # The data's shape without the head axis H: k [B, K, H, S] (axis 2), v [B, K, S, H] and pools (axis 3).
      want = tuple(d for i, d in enumerate(data.shape) if i != (2 if name == "k_scale" and not paged else 3))
      if addressing[name].shape != want:
        raise ValueError(f"{name} must have the shape {want} (the cache's {data.shape} without its head axis), "
                         f"got {addressing[name].shape}")


def kernel_target(q, k_cache, v_cache, addressing: dict) -> str | None:
  """The kernel's FFI target for these operands, or None where they stay with XLA."""
  paged, quantized = "page_table" in addressing, "k_scale" in addressing
  stored = jnp.int8 if quantized else jnp.float32
  if q.dtype != jnp.float32 or k_cache.dtype != stored or v_cache.dtype != stored:
    return None
  if quantized and not addressing["k_scale"].dtype == addressing["v_scale"].dtype == jnp.float32:
    return None
  if paged and (addressing["page_table"].dtype != jnp.int32 or k_cache.size > MAX_POOL_ENTRIES):
    return None
  if not (build.single_cpu() and build.available("attention")):
    return None
  return TARGETS[paged, quantized]


def cache_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array,
                    xla: Callable, **addressing) -> jax.Array:
  """q [B, 1, N, H] (rotated), a cache's k_cache and v_cache and its addressing arrays (see the
  module docstring), lengths int32[B]: row b reads positions [0, lengths[b]] -> [B, 1, N, H].
  `xla(q, k_cache, v_cache, lengths, **addressing)` is the same computation in XLA."""
  if q.shape[1] != 1:
    raise ValueError(f"cache_attention takes one query token per row, got q of shape {q.shape}")
  check_addressing(q, k_cache, v_cache, addressing)
  target = kernel_target(q, k_cache, v_cache, addressing)
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
    grouped = q.reshape(b, kv_heads, n // kv_heads, h) * (h ** -0.5)  # [B, K, G, H]: query head n reads kv head n // G
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(grouped.shape, q.dtype), vmap_method="sequential")(
        grouped, k_cache, v_cache, *extra, lengths.astype(jnp.int32) + 1)
    return out.reshape(b, 1, n, h)

  kernel.defjvp(lambda primals, tangents: (kernel(*primals), jax.jvp(reference, primals, tangents)[1]))
  return jax.lax.platform_dependent(q, k_cache, v_cache, lengths, *extra, cpu=kernel, default=reference)
