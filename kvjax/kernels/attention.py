"""Attention in kvjax's CPU kernels: one query token per row against a cache
(csrc/decode_attention.cc, `cache_attention`), and a call's queries over its own keys, a prefill
(csrc/prompt_attention.cc, `prompt_attention`, at the end of this module).

The kernel reads only each row's valid positions, in place, where XLA's masked attention reads
the whole buffer (and over pages, a gathered copy of it). `cache_attention` is the route a decode
backend plugs in (kvjax.model.backend); the cache kind names its storage by a route
(layout, codec) and passes it as it is, with its addressing arrays:

  layout       k_cache, v_cache                     addressing
  contiguous   [B, K, H', S], [B, K, S, H']          scales (below)
  paged        page pools [K, P, Z, H'] each         scales (below), page_table int32[B, M]

  codec          stored as         H'      k_scale, v_scale (float32; contiguous / paged)
  float32        float32           H       none
  bfloat16       uint16 (its bits) H       none
  float16        float16           H       none
  int8           int8              H       one per (position, kv head): [B, K, S] / [K, P, Z]
  float8_e4m3fn  uint8 (its bits)  H       as int8
  int4           uint8, 2 codes    H / 2   G groups' steps then zero points: k [B, K, 2G, S] and
                                           v [B, K, S, 2G] / both [K, P, Z, 2G]

(kvjax.cache.codec: a stored value is value * scale, or (code - zero) * step for int4; the
kernel widens each element as it reads it, so a step reads the codec's bytes.) Float32 queries
over these, on a single CPU device, go to the kernel; everything else (other dtypes, addressing
or scale shapes, accelerators, meshes) to the XLA computation it is given. The choice between
the two is made when lowering, so a function traced here may still be compiled for an
accelerator. Gradients are XLA's: the kernel only runs forward.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels import build

# The codecs the kernel reads: name -> (stored dtype, elements per stored entry, scales), scales
# being None, "vector" (one per stored vector) or "grouped" (int4's steps and zero points).
CODECS = {
  "float32": (jnp.float32, 1, None),
  "bfloat16": (jnp.uint16, 1, None),
  "float16": (jnp.float16, 1, None),
  "int8": (jnp.int8, 1, "vector"),
  "float8_e4m3fn": (jnp.uint8, 1, "vector"),
  "int4": (jnp.uint8, 2, "grouped"),
}
SUFFIXES = {
  "float32": "",
  "bfloat16": "_bf16",
  "float16": "_f16",
  "int8": "_int8",
  "float8_e4m3fn": "_fp8",
  "int4": "_int4",
}
# The cache kinds' routes (layout, codec) -> the kernel's FFI target.
TARGETS = {
  (layout, codec): f"kvjax_{'decode' if layout == 'contiguous' else 'paged'}_attention{SUFFIXES[codec]}"
  for layout in ("contiguous", "paged")
  for codec in CODECS
}
TARGET = TARGETS["contiguous", "float32"]
# KIVI's 4-bit layout (kvjax.cache.layouts.kivi; csrc/kivi_attention.cc): key codes [B, K, H / 2, S] (transposed)
# and value codes [B, K, S, H / 2], with keys' per-channel scales [B, K, S / 32, 2, H], values' per-token ones [B, K, S, 2, H / 32] and the float
# residuals [B, K, 32, H] of each row's last partial group.
KIVI_ROUTE = ("kivi", "kivi4")
TARGETS[KIVI_ROUTE] = "kvjax_kivi_attention"
KIVI_GROUP = 32  # the kernel's kGroup; kvjax.cache.codec.KIVI_GROUP is the layout's (a cache above kernels)
KIVI_ADDRESSING = ("k_scale", "v_scale", "k_residual", "v_residual")
# The kernel addresses a page pool with int32 offsets: pools of this many entries or more stay with XLA.
MAX_POOL_ENTRIES = 2**31 - 4
# The addressing arrays in the kernel's operand order (after q, k_cache, v_cache).
ADDRESSING = ("k_scale", "v_scale", "page_table", "k_residual", "v_residual")


def uses_kernel(compute_dtype, route: tuple[str, str]) -> bool:
  """Whether `cache_attention` of `compute_dtype` queries over a cache kind's `route` (KVCache.route)
  runs in the CPU kernel: float32 queries over a cache of any codec in CODECS, on a single CPU device."""
  return (
    jnp.dtype(compute_dtype) == jnp.float32 and route in TARGETS and build.single_cpu() and build.available("attention")
  )


def scale_shapes(paged: bool, scales: str | None, k_shape: tuple, v_shape: tuple, groups: int) -> dict:
  """{name: shape} of the scales that a codec's storage of k_shape and v_shape carries (module
  docstring); `groups`: int4's groups per vector."""
  if scales is None:
    return {}
  if scales == "vector":
    k_seq = 2 if paged else 3  # the keys' sequence axis: pools [K, P, Z, H'], contiguous [B, K, H', S]
    return {"k_scale": (*k_shape[:2], k_shape[k_seq]), "v_scale": v_shape[:3]}
  k_scale = list(k_shape)
  k_scale[3 if paged else 2] = 2 * groups  # the keys' width axis
  return {"k_scale": tuple(k_scale), "v_scale": (*v_shape[:3], 2 * groups)}


def kivi_fits(q, k_cache, v_cache, addressing: dict) -> bool:
  """Whether the operands are KIVI's 4-bit layout as KIVI_ROUTE's kernel takes it (H a multiple of 32)."""
  if set(addressing) != set(KIVI_ADDRESSING) or q.ndim != 4 or k_cache.ndim != 4 or q.dtype != jnp.float32:
    return False
  b, _, n, h = q.shape
  kv, s = v_cache.shape[1], v_cache.shape[2]
  want = {
    "k_scale": (b, kv, s // KIVI_GROUP, 2, h),
    "v_scale": (b, kv, s, 2, h // KIVI_GROUP),
    "k_residual": (b, kv, KIVI_GROUP, h),
    "v_residual": (b, kv, KIVI_GROUP, h),
  }
  return (
    kv > 0
    and n % kv == 0
    and n // kv <= 64
    and h % KIVI_GROUP == 0
    and s % KIVI_GROUP == 0
    and k_cache.dtype == v_cache.dtype == jnp.uint8
    and k_cache.shape == (b, kv, h // 2, s)
    and v_cache.shape == (b, kv, s, h // 2)
    and all(addressing[name].dtype == jnp.float32 and addressing[name].shape == shape for name, shape in want.items())
  )


def kernel_layout(route, q, k_cache, v_cache, addressing: dict) -> tuple[bool, str] | None:
  """(paged, codec) when `route` is one of the kernel's and the operands are as the module
  docstring says it stores them (names, dtypes and shapes), else None."""
  if route == KIVI_ROUTE:
    return (False, route[1]) if kivi_fits(q, k_cache, v_cache, addressing) else None
  if route not in TARGETS:
    return None
  paged, codec = route[0] == "paged", route[1]
  stored, per_entry, scales = CODECS[codec]
  want = ({"k_scale", "v_scale"} if scales else set()) | ({"page_table"} if paged else set())
  if set(addressing) != want:
    return None
  if q.dtype != jnp.float32 or k_cache.dtype != stored or v_cache.dtype != stored or q.ndim != 4 or k_cache.ndim != 4:
    return None
  b, _, n, h = q.shape
  if h % per_entry:
    return None
  width = h // per_entry
  if paged:
    kv, pages, size, _ = k_cache.shape
    table = addressing["page_table"]
    if (
      k_cache.shape != (kv, pages, size, width)
      or v_cache.shape != k_cache.shape
      or table.dtype != jnp.int32
      or table.ndim != 2
      or table.shape[0] != b
      or k_cache.size * per_entry >= MAX_POOL_ENTRIES
    ):
      return None
  else:
    kv, s = k_cache.shape[1], k_cache.shape[3]
    if k_cache.shape != (b, kv, width, s) or v_cache.shape != (b, kv, s, width):
      return None
  if n % kv:
    return None
  groups = 0
  if scales == "grouped":  # the group count is the scales' own; each group an even number of elements
    v_scale = addressing["v_scale"]
    groups = v_scale.shape[-1] // 2 if v_scale.ndim == 4 else 0
    if not groups or v_scale.shape[-1] % 2 or h % groups or (h // groups) % 2:
      return None
  shapes = scale_shapes(paged, scales, k_cache.shape, v_cache.shape, groups)
  for name, shape in shapes.items():
    if addressing[name].dtype != jnp.float32 or tuple(addressing[name].shape) != tuple(shape):
      return None
  return paged, codec


def kernel_target(route, q, k_cache, v_cache, addressing: dict) -> str | None:
  """The kernel's FFI target for these operands, or None where they stay with XLA."""
  if kernel_layout(route, q, k_cache, v_cache, addressing) is None:
    return None
  if not (build.single_cpu() and build.available("attention")):
    return None
  return TARGETS[route]


def on_cpu(kernel: Callable, reference: Callable, *operands) -> jax.Array:
  """kernel(*operands) when lowered for the CPU, reference(*operands) elsewhere; the kernel only
  runs forward, so its derivatives are the reference's."""
  kernel = jax.custom_jvp(kernel)
  kernel.defjvp(lambda primals, tangents: (kernel(*primals), jax.jvp(reference, primals, tangents)[1]))
  return jax.lax.platform_dependent(*operands, cpu=kernel, default=reference)


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

  def kernel(q, k_cache, v_cache, lengths, *extra):
    b, _, n, h = q.shape
    grouped = q.reshape(b, kv_heads, n // kv_heads, h) * (h**-0.5)  # [B, K, G, H]: query head n reads kv head n // G
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(grouped.shape, q.dtype), vmap_method="sequential")(
      grouped, k_cache, v_cache, *extra, lengths.astype(jnp.int32) + 1
    )
    return out.reshape(b, 1, n, h)

  return on_cpu(kernel, reference, q, k_cache, v_cache, lengths, *extra)


PROMPT_TARGET = "kvjax_prompt_attention"
PROMPT_HEAD_MULTIPLE = 4  # the kernel takes head_dim in steps of 4 channels
# A kernel task holds 64 queries in vector lanes: a call of fewer than this many queries over more
# keys than it has (a decode step reading a cache by positions) would compute mostly empty lanes,
# so it stays with XLA. A call over its own keys (a prefill) takes the kernel at any length.
PROMPT_MIN_QUERIES = 16


def prompt_kernel_fits(q, k, v, keys, k_transposed: bool) -> bool:
  """Whether the prompt kernel takes these operands (csrc/prompt_attention.cc): float32 q [B, T, N, H],
  values [B, K, S, H] and keys alike (k_transposed: [B, K, H, S]), K dividing N, H a multiple of 4,
  key positions per row [B, S], shared [1, S] or per kv head [B, K, S] (an evicting cache's), and
  at least PROMPT_MIN_QUERIES queries unless the keys are no more than the queries."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    return False
  b, t, n, h = q.shape
  kv, s = v.shape[1], v.shape[2]
  positions = keys.key_positions.shape
  return (
    all(x.dtype == jnp.float32 for x in (q, k, v))
    and v.shape == (b, kv, s, h)
    and k.shape == ((b, kv, h, s) if k_transposed else (b, kv, s, h))
    and kv > 0
    and n % kv == 0
    and h % PROMPT_HEAD_MULTIPLE == 0
    and keys.q_positions.ndim == 2
    and (t >= PROMPT_MIN_QUERIES or s <= t)
    and (
      (len(positions) == 2 and positions[0] in (1, b) and positions[1] == s)
      or (len(positions) == 3 and positions[0] in (1, b) and positions[1:] == (kv, s))
    )
  )


def prompt_attention(q, k, v, keys, xla: Callable, *, k_transposed: bool = False) -> jax.Array:
  """A call's queries q [B, T, N, H] over keys and values [B, K, S, H] (k [B, K, H, S] with
  k_transposed) as `keys` (a kvjax.model.keys.Visibility) says: a prefill's own keys, or a cache's
  slots read by a call of several tokens (kvjax.model.backend.Backend.prompt_attention), in the CPU
  kernel where it takes them (`prompt_kernel_fits`, a single CPU device), else `xla(q, k, v, keys,
  k_transposed=...)`, the same computation in XLA; gradients are XLA's."""
  if not (prompt_kernel_fits(q, k, v, keys, k_transposed) and build.single_cpu() and build.available("attention")):
    return xla(q, k, v, keys, k_transposed=k_transposed)
  b, t = q.shape[:2]
  kv, s = v.shape[1], v.shape[2]
  per_head = keys.key_positions.ndim == 3
  q_pos = jnp.broadcast_to(keys.q_positions, (b, t)).astype(jnp.int32)
  k_pos = jnp.broadcast_to(keys.key_positions, (b, kv, s) if per_head else (b, s)).astype(jnp.int32)
  window = keys.window

  def reference(q, k, v, q_pos, k_pos):
    return xla(q, k, v, type(keys)(q_pos, k_pos, window), k_transposed=k_transposed)

  def kernel(q, k, v, q_pos, k_pos):
    heads = k_pos if per_head else jnp.broadcast_to(k_pos[:, None], (b, kv, s))
    call = jax.ffi.ffi_call(PROMPT_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(
      q,
      k,
      v,
      q_pos,
      heads,
      window=np.int64(window.size),
      sinks=np.int64(window.sinks),
      k_transposed=np.int64(k_transposed),
    )

  return on_cpu(kernel, reference, q, k, v, q_pos, k_pos)
