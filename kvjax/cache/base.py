"""The cache interface: a cache is a layout x a codec x the payload the attention declares.

  payload  what a layer's attention hands its cache per token (kvjax.model.attention.Field):
           {k, v} of num_kv_heads x head_dim for MHA / GQA / MQA, {latent, rope_key} of one
           "head" for MLA (kvjax.model.mla). Each array is [B, heads, T, width].
  codec    how each vector is stored (kvjax.cache.codec): float, int8, int4, fp8; a quantized
           codec keeps float32 scales beside the values, under "{name}_scale".
  layout   where a token's vectors go and how a read gathers them: the subclasses
           (contiguous rows and rings, kvjax.cache.layouts.contiguous; pages, kvjax.cache.layouts.paged).

A cache is plain data (a flax.struct pytree) returned new by every call: its per-layer arrays,
which travel into the model as the Flax 'cache' collection, plus per-row bookkeeping. One write
and one attend serve every payload and codec; a layout implements `write` (encoded arrays to
its slots), `read` (the decoded arrays and the mask of what each query sees), and on the host
`capacity`, `layer_spec` and `check_room`. Any layout takes any codec and any payload.
The layer loop, the decode functions and the engine only call this interface; see docs/design.md.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import rotation as rotations
from kvjax.cache.codec import Codec, codec as codec_named
from kvjax.cache.config import CacheConfig
from kvjax.config import ModelConfig
from kvjax.model.attention import Field, Span, new_keys, row_positions
from kvjax.model.keys import Window
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_layers, cache_payload

SCALE = "_scale"  # a quantized field's scales are stored as "{name}_scale"


def scale_shape(values_shape: tuple[int, ...], codec: Codec, field: Field, width_axis: int) -> tuple[int, ...] | None:
  """The shape of the scales stored beside values of `values_shape` whose width axis is
  `width_axis`: that axis replaced by the codec's groups, or dropped for one scale per vector;
  None for a float codec."""
  groups = codec.scale_groups(field.width)
  if not groups:
    return None
  shape = list(values_shape)
  if codec.grouped:
    shape[width_axis] = groups
  else:
    del shape[width_axis]
  return tuple(shape)


def encode(codec: Codec, new: dict) -> dict:
  """This call's payload {name: [B, heads, T, width]} as stored: {name: values [B, heads, T, W']}
  and, quantized, {name_scale: [B, heads, T] or [B, heads, T, groups]}."""
  out = {}
  for name, x in new.items():
    out[name], scale = codec.encode(x)
    if scale is not None:
      out[name + SCALE] = scale
  return out


class KVCache(flax.struct.PyTreeNode, kw_only=True):
  """Base of the cache layouts.

  layers: the 'cache' collection, {'layers_{i}': {'attn': {name: array}}}.
  lengths: int32[B], tokens each row holds; the next token of row b goes to position lengths[b].
  codec, payload (static): how vectors are stored, and what each layer stores ((name, Field) pairs).
  window, sink_tokens (static): the sliding windows the cache was made for (ModelConfig's, or a
    CacheConfig's override); every layer's attention masks by them.
  window_override (static): they are a CacheConfig's, decoding any model in place of its own;
    otherwise they are the model's, and a model of other windows decodes with its own (a
    contiguous cache's rings then no longer fit it: `check_model` refuses it).
  absorb (static): read an MLA payload in the absorbed form (kvjax.model.mla).
  rotation (static): the CacheConfig's rotation (kvjax.cache.rotation): keys and values are stored
    rotated, queries rotated on their way in and outputs turned back on their way out
    (`rotate_in`, `rotate_out`, which every attention module calls around `attend`).
  limit: int32 scalar, the positions a row may hold when the storage was made larger than asked
    (a bucket, `size_bucket`: prefill's caches); None, the storage's own. A leaf, not a static
    field, so caches of one bucket share a compiled function whatever their limits.
  """

  layers: dict
  lengths: jax.Array
  limit: jax.Array | None = None
  codec: Codec = flax.struct.field(pytree_node=False, default=codec_named("float32"))
  payload: tuple = flax.struct.field(pytree_node=False, default=())
  window: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
  sink_tokens: int = flax.struct.field(pytree_node=False, default=0)
  window_override: bool = flax.struct.field(pytree_node=False, default=False)
  absorb: bool = flax.struct.field(pytree_node=False, default=True)
  rotation: str | None = flax.struct.field(pytree_node=False, default=None)

  layout = ""  # the CacheConfig.layout name a subclass registers (kvjax.cache.config.register)

  @classmethod
  def statics(cls, config: ModelConfig, cache_config: CacheConfig) -> dict:
    """The static fields of a cache of `cache_config` for a model of `config`."""
    model = cache_config.model(config)
    return dict(
      codec=cache_config.codec(config),
      payload=tuple(cache_payload(config).items()),
      window=model.window,
      sink_tokens=model.sink_tokens,
      absorb=cache_config.absorb,
      rotation=cache_config.rotation,
      window_override=cache_config.window is not None or cache_config.sink_tokens is not None,
    )

  @property
  def fields(self) -> dict[str, Field]:
    return dict(self.payload)

  @property
  def route(self) -> tuple[str, str]:
    """(layout, codec): how this kind names its storage to a decode kernel (Backend.cache_attention)."""
    return (self.layout, self.codec.name)

  def call_positions(self, t: int) -> jax.Array:
    """int32[B, t]: the positions of a call of t columns, row b's from lengths[b] on."""
    return row_positions(self.lengths, t)

  # Host side.

  @property
  def storage_positions(self) -> int:
    """Positions one row's storage has room for (a bucket's, when made for one)."""
    raise NotImplementedError

  @property
  def capacity(self) -> int:
    """Positions one row may hold: the storage's, or fewer under `limit`."""
    room = self.storage_positions
    return room if self.limit is None else min(room, int(self.limit))

  @property
  def nbytes(self) -> int:
    """Bytes of what the layers store (the per-row bookkeeping excluded)."""
    return sum(x.nbytes for x in jax.tree.leaves(self.layers))

  @classmethod
  def position_bytes(cls, config: ModelConfig, cache_config: CacheConfig) -> int:
    """Bytes one position of one layer takes in a cache of `cache_config`: every payload field's
    vectors through the codec, scales included. The one formula every size in kvjax comes from."""
    codec = cache_config.codec(config)
    return sum(field.heads * codec.vector_bytes(field.width) for field in cache_payload(config).values())

  @classmethod
  def sequence_bytes(cls, config: ModelConfig, cache_config: CacheConfig, length: int) -> int:
    """Bytes a layout of this kind keeps for one sequence of `length` tokens: every layer at
    every position (the contiguous layout's rings keep fewer)."""
    return config.num_layers * length * cls.position_bytes(config, cache_config)

  def model_config(self, config: ModelConfig) -> ModelConfig:
    """`config` with the windows this cache decodes by: its CacheConfig's override, else the model's."""
    if not self.window_override or (config.window, config.sink_tokens) == (self.window, self.sink_tokens):
      return config
    return config.replace(window=self.window, sink_tokens=self.sink_tokens)

  def layer_window(self, config: ModelConfig, layer: int) -> Window:
    return Window.of_layer(self.model_config(config), layer)

  def layer_spec(self, config: ModelConfig, layer: int = 0) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{name: (shape, dtype)} of the arrays layer `layer` holds for a model of `config`, at this
    cache's sizes: what `check_model` compares against."""
    raise NotImplementedError

  def partition_rule(self, name: str) -> tuple:
    """The mesh axes of the leading axes of this cache's arrays under `name` ("layers" or a
    bookkeeping field such as "lengths"), for kvjax.sharding; axes left out are replicated."""
    return ("data",)

  def check_model(self, config: ModelConfig) -> None:
    """Raises ValueError unless this cache was made for a model of `config`: its payload, layers
    and sizes. Called on the host before compute: a cache of another model would otherwise give
    finite, wrong logits."""
    layers = cache_layers(self.layers)
    kind = type(self).__name__
    if self.fields != cache_payload(config):
      raise ValueError(
        f"the {kind} does not fit the model: it stores {sorted(self.fields)} per token "
        f"({self.fields}), the model's attention hands it {cache_payload(config)}"
      )
    if len(layers) != config.num_layers:
      raise ValueError(f"the {kind} has {len(layers)} layers but the model has num_layers={config.num_layers}")
    model = self.model_config(config)
    for i, layer in enumerate(layers):
      want = self.layer_spec(model, i)
      got = {name: (tuple(x.shape), np.dtype(x.dtype)) for name, x in layer.items()}
      if got != want:
        name = next((n for n in sorted(set(want) | set(got)) if got.get(n) != want.get(n)))
        raise ValueError(
          f"the {kind} does not fit the model: layer {i} {name} is {got.get(name)}, but a model with "
          f"num_kv_heads={config.num_kv_heads}, head_dim={config.head_dim} and window={model.window} "
          f"in a {self.codec.name} cache needs {want.get(name)}"
        )

  def first_call(self, model, params, tokens: jax.Array, lengths: jax.Array, logits_at=None):
    """The first call from an empty cache when it is not the model's plain forward pass (a
    model-level press: kvjax.cache.layouts.evict): (logits at logits_at, the new cache); None (the
    default) for the plain forward. Traced, inside the decode functions' jit."""
    return None

  def check_room(self, new_lengths: np.ndarray) -> None:
    """Raises ValueError, naming the row, unless row b can take new_lengths[b] more tokens.
    Called before compute: a write past the storage must never reach the device."""
    held = np.asarray(self.lengths)
    over = held + new_lengths > self.capacity
    if over.any():
      row = int(np.argmax(over))
      raise ValueError(
        f"cache is full: row {row} holds {int(held[row])} tokens and {int(new_lengths[row])} "
        f"more do not fit its {self.capacity} positions"
      )

  # Device side (traced): per layer, with that layer's arrays `stored` ({name: array}).

  def rotate_in(self, query, new: dict):
    """(query, new payload) as this cache stores and reads them: rotated by the cache's rotation
    (a KVQuery's q and call_q [B, T, N, H], new k and v [B, K, T, H]), unchanged without one."""
    if self.rotation is None:
      return query, new
    call_q = None if query.call_q is None else rotations.rotate(query.call_q)
    return query.replace(q=rotations.rotate(query.q), call_q=call_q), {
      name: rotations.rotate(x) for name, x in new.items()
    }

  def rotate_out(self, out: jax.Array) -> jax.Array:
    """The attention output [B, Tq, N, H] of rotated values turned back (R is its own inverse)."""
    return out if self.rotation is None else rotations.rotate(out)

  def write(self, stored: dict, new: dict, span: Span) -> dict:
    """Stores the valid columns of the payload new {name: [B, heads, T, width]} at
    span.positions, through the codec; returns the new arrays."""
    raise NotImplementedError

  def read(self, stored: dict, query, q_positions: jax.Array, span: Span, backend: Backend) -> jax.Array:
    """query (KVQuery, LatentQuery) at q_positions int[B, Tq] reads what the rows hold (this
    call's payload already written) -> [B, Tq, N, H]."""
    raise NotImplementedError

  def as_stored(self, new: dict) -> dict:
    """This call's payload as a read of the cache will see it: through the codec and back."""
    return {name: self.codec.roundtrip(x) for name, x in new.items()}

  def attend(self, stored: dict, query, q_positions, new: dict, span: Span, backend: Backend):
    """What an attention module calls: write this call's payload, then read -> (new arrays,
    [B, Tq, N, H]). From an empty cache the new payload is all there is, so it is read without
    touching the storage, but as stored (`as_stored`), so a prefill's logits are those a later
    read of the same cache gives; MLA reads it in the expanded form, as training does."""
    stored = self.write(stored, new, span)
    if span.from_empty:
      return stored, query.attend(self.as_stored(new), new_keys(q_positions, span), backend=backend)
    return stored, self.read(stored, query, q_positions, span, backend)

  def decoded(self, stored: dict, width_axes: dict[str, int]) -> dict:
    """{name: the field's arrays decoded} (float32 when quantized, as stored when float), each
    field's width axis given by width_axes."""
    return {
      name: self.codec.decode(stored[name], stored.get(name + SCALE), axis=width_axes[name]) for name in self.fields
    }

  def scales(self, stored: dict) -> dict:
    """The k_scale and v_scale arrays of a quantized K/V layer ({} when float): the keywords a
    decode kernel takes (kvjax.model.backend.Backend.cache_attention)."""
    return {name: stored[name] for name in ("k" + SCALE, "v" + SCALE) if name in stored}


def size_bucket(n: int, limit: int, floor: int = 16) -> int:
  """n rounded up to a rung of a ladder of four rungs per octave (16, 20, 24, 28, 32, 40, 48, 56,
  64, 80, ...: 2^k + j 2^(k-2)), at least floor, at most limit, never below n: padding sizes to
  buckets makes jitted functions compile once per bucket rather than once per size, and a bucket
  holds at most 1.25x what it was asked for (a power of two held up to 2x)."""
  step = max(1, (1 << (n - 1).bit_length()) // 8)  # n in (2^k, 2^(k+1)]: rungs 2^(k-2) apart
  return max(min(max(floor, -(-n // step) * step), limit), n)


def layer_arrays(spec: dict) -> dict:
  """Zeros for a layer_spec {name: (shape, dtype)}."""
  return {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in spec.items()}


def scatter_rows(buffer: jax.Array, new: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
  """Writes new[b]'s column j along `axis` into buffer[b] at slots[b, j] (int[B, T]); slots at
  buffer.shape[axis] or past it are dropped (padding; a row never overwrites what it holds by a
  clamped write). One scatter for all rows, in place when the buffer is donated; the kept slots
  of a row must be distinct (which of two writes to one slot lands is unspecified)."""
  index = [jnp.arange(new.shape[0])[:, None]] + [slice(None)] * (buffer.ndim - 1)
  index[axis] = slots
  # The two advanced indices (rows, slots) broadcast to [B, T] and lead the update's axes.
  update = jnp.moveaxis(new, axis, 1).astype(buffer.dtype)  # [B, T, ...]
  return buffer.at[tuple(index)].set(update, mode="drop")
