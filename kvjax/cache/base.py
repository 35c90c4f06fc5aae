"""The cache interface: what every cache kind provides to the one forward path.

A cache is plain data (a flax.struct pytree) returned new by every call: its per-layer arrays,
which travel into the model as the Flax 'cache' collection, plus per-row bookkeeping (`lengths`,
and whatever else the kind addresses its storage by, such as a page table). A kind decides
  - what it stores per layer (`layers`, laid out by kvjax.model.transformer.cache_collection),
  - how new K/V are written there (`write`),
  - how a query reads what is stored (`read`),
  - and, on the host before any compute, whether a call's new tokens fit (`check_room`).
The layer loop, the decode functions and the engine only call these; see docs/design.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import flax.struct

from kvjax.cache import quant
from kvjax.config import ModelConfig
from kvjax.model.attention import Span, attend, new_keys_mask
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_layers


class KVCache(flax.struct.PyTreeNode):
  """Base of the cache kinds.

  layers: the 'cache' collection, {'layers_{i}': {'attn': {name: array}}}.
  lengths: int32[B], tokens each row holds; the next token of row b goes to position lengths[b].
  """

  layers: dict
  lengths: jax.Array
  latent = False  # a class attribute, not a field: the kind holds MLA latents (kvjax.cache.latent)

  # Host side.

  @property
  def capacity(self) -> int:
    """Positions one row can hold."""
    raise NotImplementedError

  @property
  def nbytes(self) -> int:
    """Bytes of the stored K/V (every layer's arrays; the per-row bookkeeping excluded)."""
    return sum(x.nbytes for x in jax.tree.leaves(self.layers))

  def layer_spec(self, config: ModelConfig, layer: int = 0) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{name: (shape, dtype)} of the arrays layer `layer` of this cache holds for a model of
    `config`, at this cache's batch and capacity: what `check_model` compares against."""
    raise NotImplementedError

  def check_model(self, config: ModelConfig) -> None:
    """Raises ValueError unless this cache was made for a model of `config`: its layers, kv
    heads, head dim and dtype, and a capacity within ModelConfig.max_len. Called on the host
    before compute: a cache of another model would otherwise give finite, wrong logits."""
    layers = cache_layers(self.layers)
    kind = type(self).__name__
    if self.latent != config.is_latent:
      raise ValueError(f"the {kind} does not fit the model: a model with kv_latent_rank={config.kv_latent_rank} "
                       f"needs {'a latent cache (LatentCache, PagedLatentCache)' if config.is_latent else 'a K/V cache'}")
    if len(layers) != config.num_layers:
      raise ValueError(f"the {kind} has {len(layers)} layers but the model has num_layers={config.num_layers}")
    for i, layer in enumerate(layers):
      want = self.layer_spec(config, i)
      got = {name: (tuple(x.shape), np.dtype(x.dtype)) for name, x in layer.items()}
      if got != want:
        name = next((n for n in sorted(set(want) | set(got)) if got.get(n) != want.get(n)))
        raise ValueError(
            f"the {kind} does not fit the model: layer {i} {name} is {got.get(name)}, but a model with "
            f"num_kv_heads={config.num_kv_heads}, head_dim={config.head_dim}, cache_dtype={config.cache_dtype} "
            f"and window={config.window} needs {want.get(name)}")

  def check_room(self, new_lengths: np.ndarray) -> None:
    """Raises ValueError, naming the row, unless row b can take new_lengths[b] more tokens.
    Called before compute: a write past the storage must never reach the device."""
    held = np.asarray(self.lengths)
    over = held + new_lengths > self.capacity
    if over.any():
      row = int(np.argmax(over))
      raise ValueError(f"cache is full: row {row} holds {int(held[row])} tokens and {int(new_lengths[row])} "
                       f"more do not fit its {self.capacity} positions")

  # Device side (traced): per layer, with that layer's arrays `stored` ({name: array}).

  def write(self, stored: dict, k: jax.Array, v: jax.Array, span: Span) -> dict:
    """Stores the valid columns of k, v [B, K, T, H] at span.positions (quantized when the
    cache's format is, kvjax.cache.quant); returns the new arrays."""
    raise NotImplementedError

  def read(self, stored: dict, q: jax.Array, q_positions: jax.Array, span: Span, backend: Backend) -> jax.Array:
    """Queries q [B, Tq, N, H] at q_positions int[B, Tq] attend causally to what the rows hold
    (this call's K/V already written) -> [B, Tq, N, H]."""
    raise NotImplementedError

  def attend(self, stored: dict, q, q_positions, k, v, span: Span, backend: Backend):
    """What the layer loop calls: write this call's K/V, then attend -> (new arrays, [B, Tq, N, H]).
    From an empty cache the new K/V are all there is, so they are read without touching the
    storage, but as it holds them (`as_stored`: rounded to a narrower float dtype, or
    dequantize(quantize(.))), so a prefill's logits are those a later read of the same cache gives."""
    stored = self.write(stored, k, v, span)
    if span.from_empty:
      k, v = as_stored(k, stored), as_stored(v, stored)
      return stored, attend(q, k, v, new_keys_mask(q_positions, span))
    return stored, self.read(stored, q, q_positions, span, backend)


def stored_format(stored: dict) -> str | None:
  """The quantized format (kvjax.cache.quant) of one layer's arrays, or None for a float cache."""
  return quant.format_of(stored["k"].dtype)


def as_stored(x: jax.Array, stored: dict) -> jax.Array:
  """New K or V [B, K, T, H] as a read of one layer's arrays `stored` would see them, in x's dtype."""
  fmt = stored_format(stored)
  if fmt is not None:
    return quant.roundtrip(x, fmt)
  return x.astype(stored["k"].dtype).astype(x.dtype)


def scales(stored: dict) -> dict:
  """The scale arrays of one layer ({} for a float cache): the keywords a quantized read hands
  backend.cache_attention."""
  return {name: stored[name] for name in ("k_scale", "v_scale") if name in stored}


def layer_arrays(spec: dict) -> dict:
  """Zeros for a layer_spec {name: (shape, dtype)}."""
  return {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in spec.items()}


def write_rows(buffer: jax.Array, new: jax.Array, starts: jax.Array, counts: jax.Array, axis: int) -> jax.Array:
  """Writes new[b]'s first counts[b] entries along `axis` into buffer[b] from position starts[b].

  buffer [B, ..., S, ...], new [B, ..., T, ...] (the sequence axis `axis`). One scatter for all
  rows, in place when the buffer is donated. The columns past counts[b] (padding) are sent to
  position S, out of range, and dropped: a row near its end may take a chunk padded past it, and
  nothing it holds is overwritten. (A per-row lax.dynamic_update_slice would instead clamp such
  a write back over the row's last tokens.) Callers check starts + counts <= S beforehand.
  """
  width, size = new.shape[axis], buffer.shape[axis]
  columns = jnp.arange(width)[None, :]
  positions = jnp.where(columns < counts[:, None], starts[:, None] + columns, size)  # [B, T]
  return scatter_rows(buffer, new, positions, axis)


def scatter_rows(buffer: jax.Array, new: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
  """Writes new[b]'s column j along `axis` into buffer[b] at slots[b, j] (int[B, T]); slots at
  buffer.shape[axis] or past it are dropped. One scatter for all rows; the kept slots of a row
  must be distinct (which of two writes to one slot lands is unspecified)."""
  index = [jnp.arange(new.shape[0])[:, None]] + [slice(None)] * (buffer.ndim - 1)
  index[axis] = slots
  # The two advanced indices (rows, slots) broadcast to [B, T] and lead the update's axes.
  update = jnp.moveaxis(new, axis, 1).astype(buffer.dtype)  # [B, T, ...]
  return buffer.at[tuple(index)].set(update, mode="drop")
