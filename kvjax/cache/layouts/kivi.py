"""KIVI's layout (Liu et al. 2024): CacheConfig(dtype="kivi2" or "kivi4").

Keys are quantized per channel, each channel's GROUP consecutive tokens sharing a step and a zero
point (a key channel's outliers stay within that channel); values per token, in groups of GROUP
channels. A group of tokens is quantized only once it is full: until then the row's most recent
tokens (its last len % GROUP) sit in a float residual, exact. Quantization is asymmetric
(kvjax.cache.codec's int4 rule at `bits`): q = round(x / s) + z in [0, 2^bits - 1],
s = (max - min) / (2^bits - 1) over the group and 0, z = round(-min / s); x = (q - z) * s.

Per layer, for a model of K kv heads of width H, rows of S = max_len rounded up to GROUP:
  k               uint8 [B, K, H * bits / 8, S]: the key codes, packed along the channels (8 / bits
                  per byte, element j of a byte's run in bits j * bits and up), transposed: each
                  byte row runs along the positions, as a group's per-channel scales do
  v               uint8 [B, K, S, H * bits / 8]: the value codes, packed alike, by position
  k_scale         float32 [B, K, S / GROUP, 2, H]: each token group's per-channel steps, zero points
  v_scale         float32 [B, K, S, 2, H / GROUP]: each token's per-group steps, zero points
  k_residual, v_residual  float32 [B, K, GROUP, H]: the positions of the group being filled
A write stages the residual and the call's tokens side by side (positions from the residual's
group start), quantizes the groups the call fills and keeps the last, partial one as the new
residual. A decode step at 4 bits reads the codes in place (kvjax.kernels.attention's KIVI_ROUTE,
csrc/kivi_attention.cc); other reads decode every position and attend in XLA: a query at position t reads the groups filled by t + 1 tokens decoded and the rest exact, as a
decode step at t does, so prefill, extend and decode give the same logits. Global K/V layers only: a sliding window's ring and an MLA latent are refused, as are
the paged and evicting layouts (CacheConfig).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from kvjax import memory
from kvjax.cache.base import KVCache, layer_arrays, scatter_rows
from kvjax.cache.codec import KIVI_GROUP as GROUP
from kvjax.cache.config import CacheConfig, register
from kvjax.config import ModelConfig
from kvjax.fields import check_positive_int
from kvjax.model.attention import Span
from kvjax.model.keys import Visibility, attend
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection, cache_payload


def quantize(x: jax.Array, bits: int, axis: int) -> tuple[jax.Array, jax.Array]:
  """Asymmetric quantization of x's groups along `axis` -> (codes int32 of x's shape, steps and
  zero points float32 [..., 2, ...] with `axis` replaced by the pair)."""
  levels = float(2**bits - 1)
  x = x.astype(jnp.float32)
  low = jnp.minimum(jnp.min(x, axis=axis, keepdims=True), 0.0)
  step = (jnp.maximum(jnp.max(x, axis=axis, keepdims=True), 0.0) - low) / levels
  safe = jnp.where(step > 0, step, 1.0)
  zero = jnp.clip(jnp.round(-low / safe), 0, levels)
  codes = jnp.clip(jnp.round(x / safe) + zero, 0, levels).astype(jnp.int32)
  return codes, jnp.concatenate([step, zero], axis=axis)


def dequantize(codes: jax.Array, scale: jax.Array, axis: int) -> jax.Array:
  """(codes - z) * s with the step and zero point pair of `scale` at `axis` broadcast along it."""
  step, zero = jnp.split(scale, 2, axis=axis)
  return (codes.astype(jnp.float32) - zero) * step


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """int codes [..., H] -> uint8 [..., H * bits / 8]."""
  per = 8 // bits
  codes = codes.reshape(*codes.shape[:-1], -1, per)
  return sum(codes[..., j] << (j * bits) for j in range(per)).astype(jnp.uint8)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
  """uint8 [..., H * bits / 8] -> int32 codes [..., H]."""
  per, mask = 8 // bits, 2**bits - 1
  codes = jnp.stack([(packed.astype(jnp.int32) >> (j * bits)) & mask for j in range(per)], axis=-1)
  return codes.reshape(*packed.shape[:-1], -1)


def dequantized(stored: dict, bits: int) -> dict:
  """{k, v: float32 [B, K, S, H]}: every slot's codes of a layer's arrays decoded (zeros where none is written)."""
  out = {}
  for name in ("k", "v"):
    codes = unpack(stored[name] if name == "v" else stored[name].swapaxes(2, 3), bits)  # [B, K, S, H]
    if name == "k":
      scale = jnp.repeat(stored["k_scale"], GROUP, axis=2)  # [B, K, S, 2, H]
      out[name] = dequantize(codes[:, :, :, None], scale, axis=3)[:, :, :, 0]
    else:
      grouped = codes.reshape(*codes.shape[:3], -1, 1, GROUP)  # [B, K, S, H/G, 1, G]
      scale = stored["v_scale"].swapaxes(3, 4)[..., None]  # [B, K, S, H/G, 2, 1]
      out[name] = dequantize(grouped, scale, axis=4)[..., 0, :].reshape(codes.shape)
  return out


def readable(stored: dict, held: jax.Array, bits: int) -> dict:
  """{k, v: float32 [B, K, S, H]} as a query at a row's last position reads a layer's arrays once
  the rows hold `held` int[B] tokens: filled groups decoded, the group being filled from the residual."""
  slots = stored["v"].shape[2]
  position = jnp.arange(slots)[None, :]
  residual_start = (held // GROUP * GROUP)[:, None]  # [B, 1]
  in_residual = (position >= residual_start)[:, None, :, None]  # [B, 1, S, 1]
  index = jnp.clip(position - residual_start, 0, GROUP - 1)[:, None, :, None]  # [B, 1, S, 1]
  decoded = dequantized(stored, bits)
  return {
    name: jnp.where(in_residual, jnp.take_along_axis(stored[name + "_residual"], index, axis=2), decoded[name])
    for name in ("k", "v")
  }


def xla_read(q, k, v, lengths, *, bits: int, **addressing) -> jax.Array:
  """A decode read in XLA (Backend.cache_attention's `xla` for KIVI's route): q [B, 1, N, H] over
  each row's positions [0, lengths[b]] of codes k [B, K, H * bits / 8, S], v [B, K, S, H * bits / 8] and their addressing
  (k_scale, v_scale, k_residual, v_residual) -> [B, 1, N, H]."""
  held = lengths + 1
  arrays = readable({"k": k, "v": v} | addressing, held, bits)
  mask = jnp.arange(v.shape[2])[None, None, :] < held[:, None, None]
  return attend(q, arrays["k"], arrays["v"], mask)


def layer_spec(config: ModelConfig, bits: int, batch: int, slots: int) -> dict:
  """{name: (shape, dtype)} of one layer (module docstring)."""
  k, h = config.num_kv_heads, config.head_dim
  f32, u8 = jnp.dtype(jnp.float32), jnp.dtype(jnp.uint8)
  return {
    "k": ((batch, k, h * bits // 8, slots), u8),
    "k_scale": ((batch, k, slots // GROUP, 2, h), f32),
    "v": ((batch, k, slots, h * bits // 8), u8),
    "v_scale": ((batch, k, slots, 2, h // GROUP), f32),
    "k_residual": ((batch, k, GROUP, h), f32),
    "v_residual": ((batch, k, GROUP, h), f32),
  }


@register("kivi")
class KiviCache(KVCache):
  """KIVI's per-channel keys, per-token values and float residual; see the module docstring.

  max_len (static): positions one row can hold (its storage: rounded up to GROUP).
  """

  max_len: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def bits(self) -> int:
    return self.codec.bits

  @classmethod
  def rows(cls, config, batch, max_len, cache_config: CacheConfig, prompt=None, bucket=False) -> "KiviCache":
    """An empty cache of `batch` rows of max_len positions (the signature every layout's `rows`
    shares; a bucket is the size itself)."""
    check_positive_int(batch, "batch")
    check_positive_int(max_len, "max_len")
    statics = cls.statics(config, cache_config)
    model = cache_config.model(config)
    if any(model.window) or set(cache_payload(config)) != {"k", "v"}:
      raise ValueError(
        f"CacheConfig.dtype={cache_config.dtype!r} (KIVI) stores global K/V layers only; this model has "
        f"window={model.window} and caches {sorted(cache_payload(config))}"
      )
    model.check_length(max_len, f"a cache of max_len={max_len} positions")
    memory.check_fits(
      f"a KIVI cache of {batch} rows x {max_len} positions", cls.bytes_for(config, cache_config, batch, max_len)
    )
    slots = -(-max_len // GROUP) * GROUP
    bits = statics["codec"].bits
    layers = cache_collection(config, lambda i: layer_arrays(layer_spec(config, bits, batch, slots)))
    return cls(layers=layers, lengths=jnp.zeros((batch,), jnp.int32), max_len=max_len, **statics)

  @classmethod
  def bytes_for(cls, config, cache_config, batch, max_len, prompt=None) -> int:
    """Bytes of rows(...): every position's codes and scales, each row's residuals, the lengths."""
    slots = -(-max_len // GROUP) * GROUP
    residual = 2 * config.num_kv_heads * GROUP * config.head_dim * 4
    per_row = config.num_layers * (slots * cls.position_bytes(config, cache_config) + residual)
    return batch * per_row + 4 * batch

  @property
  def storage_positions(self) -> int:
    return self.max_len

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    return layer_spec(config, self.bits, self.lengths.shape[0], self.layers_slots)

  @property
  def layers_slots(self) -> int:
    return -(-self.max_len // GROUP) * GROUP

  def write(self, stored, new, span: Span):
    return self.staged_write(stored, new, span)[0]

  def staged_write(self, stored: dict, new: dict, span: Span) -> tuple[dict, dict, jax.Array]:
    """Stages [residual | this call's tokens] from the residual's group start, quantizes the
    groups the call fills into their slots and keeps the group being filled as the new residual
    -> (new arrays, the staged float {k, v} [B, K, L, H], the staged first position int[B])."""
    slots = stored["v"].shape[2]
    held = span.positions[:, 0]  # int[B]: tokens each row held before the call
    end = held + span.lengths
    start = held // GROUP * GROUP
    staged_len = -(-(GROUP + span.positions.shape[1]) // GROUP) * GROUP
    groups = staged_len // GROUP
    at = jnp.where(span.valid, span.positions - start[:, None], staged_len)  # [B, T]
    group_start = start[:, None] + GROUP * jnp.arange(groups)[None, :]  # [B, L / G]
    full = group_start + GROUP <= end[:, None]
    token_slots = jnp.where(jnp.repeat(full, GROUP, axis=1), start[:, None] + jnp.arange(staged_len)[None, :], slots)
    out, staged = {}, {}
    for name in ("k", "v"):
      residual = stored[name + "_residual"]  # [B, K, G, H]
      x = jnp.zeros(residual.shape[:2] + (staged_len, residual.shape[-1]), jnp.float32).at[:, :, :GROUP].set(residual)
      x = scatter_rows(x, new[name].astype(jnp.float32), at, axis=2)  # [B, K, L, H]
      grouped = x.reshape(*x.shape[:2], groups, GROUP, -1)  # [B, K, L / G, G, H]
      if name == "k":  # per channel over the group's tokens
        codes, scale = quantize(grouped, self.bits, axis=3)  # [B, K, L/G, G, H], [B, K, L/G, 2, H]
        out["k_scale"] = scatter_rows(stored["k_scale"], scale, jnp.where(full, group_start // GROUP, slots), axis=2)
      else:  # per token over groups of channels
        codes, scale = quantize(x.reshape(*x.shape[:3], -1, GROUP), self.bits, axis=4)  # [B, K, L, H/G, 2]
        out["v_scale"] = scatter_rows(stored["v_scale"], scale.swapaxes(3, 4), token_slots, axis=2)
      packed = pack(codes.reshape(x.shape), self.bits)  # [B, K, L, H * bits / 8]
      if name == "k":  # stored transposed: each byte row of channels along the positions
        out[name] = scatter_rows(stored[name], packed.swapaxes(2, 3), token_slots, axis=3)
      else:
        out[name] = scatter_rows(stored[name], packed, token_slots, axis=2)
      last = ((end - start) // GROUP)[:, None, None, None, None]  # the group being filled
      out[name + "_residual"] = jnp.take_along_axis(grouped, last, axis=2)[:, :, 0]
      staged[name] = x
    return out, staged, start

  def dequantized(self, stored: dict) -> dict:
    """{k, v: float32 [B, K, S, H]}: every slot's codes decoded (zeros where none is written)."""
    return dequantized(stored, self.bits)

  def readable(self, stored: dict, held: jax.Array) -> dict:
    """{k, v: float32 [B, K, S, H]} as a query at a row's last position reads them once the rows
    hold `held` int[B] tokens (module function `readable`)."""
    return readable(stored, held, self.bits)

  def read(self, stored, query, q_positions, span: Span, backend: Backend):
    """As KVCache.read, for queries at each row's last position."""
    held = span.positions[:, 0] + span.lengths
    keys = Visibility(q_positions, jnp.arange(stored["v"].shape[2])[None, :], span.window)
    return query.attend(self.readable(stored, held), keys)

  def write_one(self, stored: dict, new: dict, span: Span) -> dict:
    """staged_write for a call of one token per row (or none): the token joins its row's
    residual, and only when some row's call fills a group is anything quantized (most steps
    write one residual entry)."""
    held = span.positions[:, 0]
    fills = jnp.any((span.lengths > 0) & ((held + span.lengths) % GROUP == 0))

    def residual_only(stored):
      rows = jnp.arange(held.shape[0])
      index = jnp.where(span.lengths > 0, held % GROUP, GROUP)  # a row without a token writes nothing
      out = dict(stored)
      for name in ("k", "v"):
        residual = stored[name + "_residual"]  # [B, K, G, H]
        out[name + "_residual"] = residual.at[rows, :, index].set(
          new[name][:, :, 0].astype(residual.dtype), mode="drop"
        )
      return out

    return jax.lax.cond(fills, lambda stored: self.staged_write(stored, new, span)[0], residual_only, stored)

  def decode_read(self, stored, query, span: Span, backend: Backend):
    """One query per row over what the row holds after the call, through Backend.cache_attention
    (kvjax.kernels.attention.KIVI_ROUTE reads the codes in place for 4 bits; `xla_read` is its XLA form)."""
    addressing = {name: stored[name] for name in ("k_scale", "v_scale", "k_residual", "v_residual")}
    held = span.positions[:, 0] + span.lengths
    xla = functools.partial(xla_read, bits=self.bits)
    return backend.cache_attention(
      self.route, query.kernel_query, stored["k"], stored["v"], held - 1, xla, **addressing
    )

  def attend(self, stored, query, q_positions, new, span: Span, backend: Backend):
    """Writes, then each query at t reads what a decode step at t reads: the groups filled by
    position t decoded (s < (t + 1) // GROUP * GROUP), the later keys up to t in float, from the
    staged tokens (which hold every position a query of the call may read in float). So a
    prefill's logits are its decode steps', and a row's store depends on the tokens alone."""
    if q_positions.shape[1] == 1 and query.kernel_query is not None:  # a decode step: the backend's route
      stored = self.write_one(stored, new, span)
      return stored, self.decode_read(stored, query, span, backend)
    stored, staged, start = self.staged_write(stored, new, span)
    decoded = self.dequantized(stored)
    t = q_positions[:, :, None]  # [B, Tq, 1]
    cut = (t + 1) // GROUP * GROUP
    quantized = jnp.arange(decoded["k"].shape[2])[None, None, :] < cut  # [B, Tq, S]
    p = (start[:, None] + jnp.arange(staged["k"].shape[2])[None, :])[:, None, :]  # [B, 1, L]
    exact = (p <= t) & (p >= cut)  # [B, Tq, L]
    k = jnp.concatenate([decoded["k"], staged["k"]], axis=2)  # [B, K, S + L, H]
    v = jnp.concatenate([decoded["v"], staged["v"]], axis=2)
    return stored, attend(query.q, k, v, jnp.concatenate([quantized, exact], axis=-1))
