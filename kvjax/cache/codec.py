"""Codecs: how a cache encodes the vectors it stores and decodes them on read.

A codec works on vectors along the last axis, x [..., W] (a head's key or value, an MLA latent),
whatever the layout that holds them. It stores `values` [..., W'] in `stored_dtype` and, when
quantized, float32 `scale` beside them: [...] (one per vector) or [..., W / group] (grouped).

  float32, float16   the vector cast to that dtype, no scale
  bfloat16       the vector rounded to bfloat16, stored as its bits (uint16), no scale
  int8           symmetric absmax: q = round(x / s) in [-127, 127], s = max|x| / 127 per vector
  int4           asymmetric in groups of `int4_group_size(W)` elements: q = round(x / s) + z in
                 [0, 15], s = (max - min) / 15 over the group and 0, z = round(-min / s) (an
                 integer zero point); x = (q - z) * s. q is a nibble, two per uint8 byte (element
                 2j in the low nibble of byte j, 2j + 1 in the high one): W/2 bytes, and 2 float32
                 per group (the scale holds the G steps, then the G zero points). All 16 levels
                 span each group's range: rotary keys' outlier channels cost a symmetric absmax
                 codec most of its levels (SmolLM2's perplexity through the cache at 1,024 tokens:
                 +23% symmetric with one scale per 32, +8% with the zero point)
  float8_e4m3fn  x / s cast to e4m3 (round to nearest), s = max|x| / 448 per vector: the scale puts
                 each vector's largest element at e4m3's largest finite value, so no vector
                 overflows (e4m3fn has no infinity) and small vectors keep their mantissa bits;
                 stored as its bits (uint8)

bfloat16 and e4m3 are stored as unsigned integers of their width because XLA's CPU backend
scatters a buffer of either by widening all of it to float32 and back (a copy of the cache per
write); a scatter of its bits moves only the new entries, and a read reinterprets them (a bitcast,
or the CPU kernel's own load).

An all-zero vector (a cache's empty slots) gets scale 0 (and int4 zero point 0) and decodes to
zeros. Decoding is values * scale in float32 (int4: (q - z) * s, exact integers times the step),
the same arithmetic wherever it runs, so attending to a fresh prefill's roundtrip(k) equals
attending later to what the cache stored. A new codec is one class
here and one entry in CODECS.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import DTYPES

INT8_MAX = 127.0
INT4_LEVELS = 15.0
INT4_MAX_GROUP = 32
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
SCALE_BYTES = 4  # float32 scales


def int4_group_size(width: int) -> int:
  """Elements that share one int4 scale: the largest even divisor of `width` up to 32 (32 for
  head dims 64 or 128; the width itself when it is at most 32)."""
  return max(g for g in range(2, min(INT4_MAX_GROUP, width) + 1, 2) if width % g == 0)


def _safe(scale: jax.Array) -> jax.Array:
  return jnp.where(scale > 0, scale, 1.0)


@dataclasses.dataclass(frozen=True)
class Codec:
  """A float codec: values cast to `name`'s dtype, no scale. Hashable: a static of the jitted cache."""

  name: str

  quantized = False
  grouped = False  # the scale has a group axis where the values have their width axis

  @property
  def stored_dtype(self) -> np.dtype:
    return np.dtype(jnp.dtype(self.name))

  def check_width(self, width: int, what: str) -> None:
    """Raises ValueError unless vectors of `width` can be stored (`what` names them)."""

  def stored_width(self, width: int) -> int:
    return width

  def scale_groups(self, width: int) -> int:
    """float32 scales per vector: 0 for a float codec."""
    return 0

  def vector_bytes(self, width: int) -> int:
    """Bytes one stored vector of `width` occupies, scales included."""
    return self.stored_width(width) * self.stored_dtype.itemsize + SCALE_BYTES * self.scale_groups(width)

  def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """x [..., W] -> (values [..., W'], scale float32 or None)."""
    return x.astype(self.stored_dtype), None

  def decode(self, values: jax.Array, scale: jax.Array | None, axis: int = -1) -> jax.Array:
    """Inverse of `encode` with the width axis of `values` (and of a grouped scale) at `axis`:
    -1 for [..., W] layouts, 2 for keys stored transposed [B, K, W, S]. A float codec returns the
    values as stored."""
    return values

  def roundtrip(self, x: jax.Array) -> jax.Array:
    """decode(encode(x)) in x's dtype: what a read of stored x sees."""
    return self.decode(*self.encode(x)).astype(x.dtype)


class AsBits:
  """A codec whose values are a narrow float (`narrow`) stored as the unsigned integers of its
  width (module docstring): `bits` and `unbits` convert, without changing a bit."""

  narrow: type

  @property
  def stored_dtype(self) -> np.dtype:
    return np.dtype(f"uint{8 * np.dtype(self.narrow).itemsize}")

  def bits(self, x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(self.narrow), self.stored_dtype)

  def unbits(self, values: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(values, self.narrow)


@dataclasses.dataclass(frozen=True)
class Bfloat16(AsBits, Codec):
  """bfloat16 values stored as their bits."""

  name: str = "bfloat16"
  narrow = jnp.bfloat16

  def encode(self, x):
    return self.bits(x), None

  def decode(self, values, scale, axis=-1):
    return self.unbits(values)


@dataclasses.dataclass(frozen=True)
class Int8(Codec):
  name: str = "int8"
  quantized = True

  def scale_groups(self, width: int) -> int:
    return 1

  def encode(self, x):
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX  # [...]
    return jnp.clip(jnp.round(x / _safe(scale)[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale

  def decode(self, values, scale, axis=-1):
    return values.astype(jnp.float32) * jnp.expand_dims(scale, axis)


@dataclasses.dataclass(frozen=True)
class Fp8(AsBits, Int8):
  """e4m3 values, one scale per vector as int8's, stored as their bits."""

  name: str = "float8_e4m3fn"
  narrow = jnp.float8_e4m3fn

  def encode(self, x):
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / FP8_MAX
    return self.bits(x / _safe(scale)[..., None]), scale

  def decode(self, values, scale, axis=-1):
    return super().decode(self.unbits(values), scale, axis)


@dataclasses.dataclass(frozen=True)
class Int4(Codec):
  name: str = "int4"
  quantized = True
  grouped = True

  @property
  def stored_dtype(self) -> np.dtype:
    return np.dtype(np.uint8)

  def check_width(self, width, what):
    if width % 2:
      raise ValueError(f"an int4 cache packs two values per byte, which needs an even width; {what} is {width} wide")

  def stored_width(self, width):
    return width // 2

  def scale_groups(self, width):
    return 2 * (width // int4_group_size(width))

  def encode(self, x):
    x = x.astype(jnp.float32)
    w = x.shape[-1]
    group = int4_group_size(w)
    grouped = x.reshape(*x.shape[:-1], w // group, group)  # [..., G, group]
    low = jnp.minimum(jnp.min(grouped, axis=-1), 0.0)  # [..., G]
    step = (jnp.maximum(jnp.max(grouped, axis=-1), 0.0) - low) / INT4_LEVELS
    zero = jnp.clip(jnp.round(-low / _safe(step)), 0, INT4_LEVELS)
    q = jnp.clip(jnp.round(grouped / _safe(step)[..., None]) + zero[..., None], 0, INT4_LEVELS)
    nibbles = q.astype(jnp.int32).reshape(*x.shape[:-1], w // 2, 2)  # [..., W/2, 2]
    return (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(jnp.uint8), jnp.concatenate([step, zero], axis=-1)

  def decode(self, values, scale, axis=-1):
    axis = axis % values.ndim
    values, scale = jnp.moveaxis(values, axis, -1), jnp.moveaxis(scale, axis, -1)  # [..., W/2], [..., 2G]
    step, zero = jnp.split(scale, 2, axis=-1)  # [..., G] each
    q = jnp.stack([values & 0xF, values >> 4], axis=-1).astype(jnp.float32)  # [..., W/2, 2]
    q = q.reshape(*values.shape[:-1], step.shape[-1], -1) - zero[..., None]  # [..., G, group]
    return jnp.moveaxis((q * step[..., None]).reshape(*values.shape[:-1], -1), -1, axis)


KIVI_GROUP = 32  # tokens per key group and channels per value group of KIVI's layout (kvjax.cache.layouts.kivi)


@dataclasses.dataclass(frozen=True)
class Kivi(Codec):
  """KIVI's codes at `bits` (kvjax.cache.layouts.kivi): the layout, not this class, quantizes (keys per
  channel over token groups, values per token), so it only names the storage and its bytes.
  Widths must be a multiple of KIVI_GROUP."""

  name: str = "kivi4"
  bits: int = 4
  quantized = True

  @property
  def stored_dtype(self) -> np.dtype:
    return np.dtype(np.uint8)

  def check_width(self, width, what):
    if width % KIVI_GROUP:
      raise ValueError(
        f"a {self.name} cache quantizes groups of {KIVI_GROUP} channels, which needs a width that is a multiple "
        f"of {KIVI_GROUP}; {what} is {width} wide"
      )

  def stored_width(self, width):
    return width * self.bits // 8

  def vector_bytes(self, width):
    """Codes plus the float32 step and zero point a vector carries: a key's share of its token
    group's per-channel pair (2 x width / KIVI_GROUP), a value's per-group pair (the same count)."""
    return self.stored_width(width) + SCALE_BYTES * 2 * width // KIVI_GROUP


KIVI = {"kivi2": Kivi("kivi2", 2), "kivi4": Kivi("kivi4", 4)}

CODECS = {
  **{name: Codec(name) for name in DTYPES},
  "bfloat16": Bfloat16(),
  "int8": Int8(),
  "int4": Int4(),
  "float8_e4m3fn": Fp8(),
}
NAMES = tuple(CODECS)
QUANTIZED = tuple(name for name, codec in CODECS.items() if codec.quantized)
# Short names a command line may use.
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}


def codec(name: str) -> Codec:
  """The codec called `name` (or one of its ALIASES, or KIVI's, which only its own layout
  takes); ValueError listing the codecs otherwise."""
  codec_ = {**CODECS, **KIVI}.get(ALIASES.get(name, name)) if isinstance(name, str) else None
  if codec_ is None:
    raise ValueError(f"cache dtype must be one of {NAMES + tuple(KIVI)}, got {name!r}")
  return codec_
