"""The quantized cache formats: how K/V are encoded on write and decoded on read.

ModelConfig.cache_dtype names the format; every cache kind stores its values under "k" and "v"
in the kind's float layout, with float32 scales beside them under "k_scale" and "v_scale":

  int8           symmetric absmax: q = round(x / s) in [-127, 127], s = max|x| / 127 over the
                 head dim, one scale per (token, kv head). The scale's shape is the values' shape
                 without the head axis H.
  int4           symmetric absmax in groups of config.int4_group_size(H) elements along the head
                 dim (32 for H = 64 or 128): q = round(x / s) in [-7, 7], s = max|x| / 7 per group,
                 stored offset by 8 as a nibble, two per uint8 byte along the head dim (element 2j
                 in the low nibble of byte j, 2j + 1 in the high one), so the head axis holds H/2
                 bytes. The scale has a group axis of H / group where the values have their head axis.
  float8_e4m3fn  x / s cast to e4m3 (round to nearest), s = max|x| / 448 per (token, kv head): the
                 scale puts each vector's largest element at e4m3's largest finite value, so no
                 vector overflows (e4m3fn has no infinity: an unscaled key past 448 would become
                 NaN) and small vectors keep their 3 mantissa bits instead of going subnormal.
                 Scale shaped as int8's.

An all-zero vector (the cache's empty slots) gets scale 0 and decodes to zeros. Decoding is
dequantize(values, scale) = q * s in float32, the same arithmetic wherever it runs, so attending
to a fresh prefill's roundtrip(k) equals attending later to what the cache stored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import QUANTIZED_CACHE_DTYPES, cache_stored_dtype, int4_group_size

INT8_MAX = 127.0
INT4_MAX = 7.0
INT4_OFFSET = 8
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
# The dtype each format stores its values in (ModelConfig.kv_dtype).
STORED = {name: np.dtype(cache_stored_dtype(name)) for name in QUANTIZED_CACHE_DTYPES}


def format_of(dtype) -> str | None:
  """The quantized format whose values are stored as `dtype`, or None for a float cache."""
  return next((name for name, stored in STORED.items() if np.dtype(dtype) == stored), None)


def _safe(scale: jax.Array) -> jax.Array:
  return jnp.where(scale > 0, scale, 1.0)


def quantize(x: jax.Array, cache_dtype: str) -> tuple[jax.Array, jax.Array]:
  """x [..., H] (any float dtype) -> (values, scale float32), quantized along the last axis.

  values: int8 [..., H], uint8 [..., H/2] (int4) or float8_e4m3fn [..., H];
  scale: [...] (int8, fp8) or [..., H / group] (int4).
  """
  if cache_dtype not in QUANTIZED_CACHE_DTYPES:
    raise ValueError(f"quantize takes one of {QUANTIZED_CACHE_DTYPES}, got {cache_dtype!r}")
  x = x.astype(jnp.float32)
  h = x.shape[-1]
  if cache_dtype == "int4":
    group = int4_group_size(h)
    grouped = x.reshape(*x.shape[:-1], h // group, group)  # [..., G, group]
    scale = jnp.max(jnp.abs(grouped), axis=-1) / INT4_MAX  # [..., G]
    q = jnp.clip(jnp.round(grouped / _safe(scale)[..., None]), -INT4_MAX, INT4_MAX)
    nibbles = (q.astype(jnp.int32) + INT4_OFFSET).reshape(*x.shape[:-1], h // 2, 2)  # [..., H/2, 2]
    return (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(jnp.uint8), scale
  top = INT8_MAX if cache_dtype == "int8" else FP8_MAX
  scale = jnp.max(jnp.abs(x), axis=-1) / top  # [...]
  scaled = x / _safe(scale)[..., None]
  if cache_dtype == "int8":
    return jnp.clip(jnp.round(scaled), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale
  return scaled.astype(jnp.float8_e4m3fn), scale


def dequantize(values: jax.Array, scale: jax.Array, cache_dtype: str, axis: int = -1) -> jax.Array:
  """Inverse of `quantize` -> float32, with the head axis of `values` (and the group axis of an
  int4 scale) at `axis`: -1 for [..., H] layouts, 2 for the contiguous cache's keys [B, K, H, S]."""
  axis = axis % values.ndim
  values = jnp.moveaxis(values, axis, -1)
  if cache_dtype == "int4":
    scale = jnp.moveaxis(scale, axis, -1)  # [..., G]
    low = (values & 0xF).astype(jnp.int32) - INT4_OFFSET
    high = (values >> 4).astype(jnp.int32) - INT4_OFFSET
    q = jnp.stack([low, high], axis=-1).astype(jnp.float32)  # [..., H/2, 2]
    groups = scale.shape[-1]
    q = q.reshape(*values.shape[:-1], groups, -1)  # [..., G, group]
    out = (q * scale[..., None]).reshape(*values.shape[:-1], -1)  # [..., H]
  elif cache_dtype in QUANTIZED_CACHE_DTYPES:
    out = values.astype(jnp.float32) * scale[..., None]
  else:
    raise ValueError(f"dequantize takes one of {QUANTIZED_CACHE_DTYPES}, got {cache_dtype!r}")
  return jnp.moveaxis(out, -1, axis)


def roundtrip(x: jax.Array, cache_dtype: str) -> jax.Array:
  """dequantize(quantize(x)) along the last axis, in x's dtype: what a read of stored x sees."""
  return dequantize(*quantize(x, cache_dtype), cache_dtype).astype(x.dtype)


def encode(k: jax.Array, v: jax.Array, cache_dtype: str | None) -> dict[str, jax.Array]:
  """This call's k, v [B, K, T, H] as the arrays a cache stores, in the same [B, K, T, ...] layout:
  {"k", "v"} as they are for a float cache (cache_dtype None), else the quantized values with
  "k_scale" and "v_scale" [B, K, T] ([B, K, T, G] for int4)."""
  if cache_dtype is None:
    return {"k": k, "v": v}
  (kq, k_scale), (vq, v_scale) = quantize(k, cache_dtype), quantize(v, cache_dtype)
  return {"k": kq, "v": vq, "k_scale": k_scale, "v_scale": v_scale}
