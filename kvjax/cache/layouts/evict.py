"""The evicting layout: each row and kv head keeps a fixed number of slots, the tokens a press
(kvjax.cache.presses) scores highest, so the cache is the budget, not max_len.

Per layer, beside the codec's arrays of the contiguous layout ([B, K, H', S] keys, [B, K, S, H']
values, their scales; kvjax.cache.layouts.contiguous) with S = the slots:
  positions  int32[B, K, S], the position each slot holds (-1: empty);
  scores     float32[B, K, S], the press's score of that token.

The first call from an empty cache (the prompt) attends over all its tokens, as a plain forward
pass does; then each layer's press scores the prompt from that layer's queries and keys and
keeps row b's int(n_b * (1 - press.compression_ratio)) best tokens, in slots 0, 1, ... (kvpress's
rule: the layer's own output is computed before its cache is compressed). Every later token
(extend, decode) takes an empty slot, lowest first, or, once a row is full, the slot of the
lowest-scoring token held (the press's arrival scores, kvjax.cache.presses): a row generates
past its budget in constant memory. A read attends over the slots each head holds, by their
positions; every head of a row fills the same number of slots, so a decode step reads slots
[0, filled) through the contiguous layout's decode route (kvjax's CPU kernel for float32 and
int8) and reads only the budget's bytes. With AdaKV's head-adaptive budgets
(the press's heads="adaptive") heads of a row keep different numbers of prompt tokens (at
most the slots each) and every read goes by positions, in XLA.

A cache for max_len positions whose first call is `prompt` tokens long has
S = max_len - (prompt - int(prompt * (1 - ratio))) slots: room for the kept prompt and every
later token, as kvpress's pipeline keeps them. With per-layer budgets (the press's
layers="pyramid") layer l keeps selection.layer_kept(press, n, l, L) of a row's n prompt tokens, and every
global layer's storage is the first (largest) layer's S: the deeper layers' spare slots hold
later tokens, so the cache takes the bytes of its largest layer (row_bytes counts them so), not
the smaller average of the pyramid.

Sliding-window layers (ModelConfig.window, e.g. Gemma 3's five local layers of every six) are
not pressed, as kvpress presses only Gemma 3's global ones: the press and its slots serve the
global layers (window 0), and a windowed layer keeps exactly what its window can still show a
later query (a query at t >= the prompt's length reads s > t - window and the sinks): after the
prompt its last `window` positions and its sink_tokens first ones, then, decoding, at most
window + sinks tokens, its oldest non-sink token going first. That is the contiguous layout's
ring of min(max_len, window + sinks) slots (kvjax.cache.layouts.contiguous, `ring`), without positions
or scores, so a windowed layer loses nothing a windowed model reads. For such a model a
compression ratio is the fraction of the global layers' prompt dropped; the windowed layers
keep their window whatever the ratio, and the cache's bytes count them at their ring.
A CacheConfig's window and sink_tokens (StreamingLLM's windows on a model trained with full
attention) combine with a press alike: they decide which layers are windowed, and the press
presses the layers they leave global. A pattern that windows every layer leaves the press
nothing to press and is refused, as are MLA's latent (one vector shared by all heads) and a
paged cache (which does not evict).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import memory
from kvjax.cache.base import encode, size_bucket
from kvjax.cache import selection
from kvjax.cache.config import CacheConfig, register
from kvjax.cache.layouts.contiguous import ContiguousCache, attend_one, layer_spec as contiguous_spec
from kvjax.cache.presses import Press, attention_weights
from kvjax.config import ModelConfig
from kvjax.fields import check_positive_int
from kvjax.model.attention import Span, new_keys
from kvjax.model.keys import Visibility
from kvjax.model.backend import Backend
from kvjax.model.rope import Rope
from kvjax.model.transformer import cache_collection

BOOKKEEPING = {"positions": jnp.dtype(jnp.int32), "scores": jnp.dtype(jnp.float32)}  # per slot and kv head


def slots_for(cache_config: CacheConfig, max_len: int, prompt: int | None) -> int:
  """Slots per row and kv head of each global layer of a cache of max_len positions whose prompt
  is `prompt` tokens (default max_len): max_len less the tokens the press drops of the prompt (at
  the layer that keeps most, with pyramid budgets)."""
  prompt = max_len if prompt is None else min(prompt, max_len)
  press = cache_config.press
  # The layer that keeps most (pyramid budgets: the first), or KVzip's heads up to their share.
  most = max(int(selection.layer_kept(press, prompt, 0, 1)), press.most_kept(prompt))
  slots = int(max_len - (prompt - most))
  return min(slots, press.decode_budget + press.headroom) if press.decode_budget else slots  # kvjax.cache.selection


def check_model(config: ModelConfig, cache_config: CacheConfig) -> None:
  """Raises ValueError unless a model of `config` can decode through an evicting cache
  (kvjax.cache.selection decides, for every evicting layout)."""
  selection.check(config, cache_config)


def layer_spec(model: ModelConfig, codec, batch: int, layer: int, max_len: int, slots: int) -> dict:
  """{name: (shape, dtype)} of layer `layer` of a model of `model` (the cache's windows): a
  windowed layer's ring (the contiguous layout's arrays at min(max_len, window + sinks)), a global
  layer's `slots` with their bookkeeping."""
  if model.layer_window(layer):
    return contiguous_spec(model, codec, batch, model.cached_positions(layer, max_len))
  spec = contiguous_spec(model, codec, batch, slots)
  heads = model.num_kv_heads
  return spec | {name: ((batch, heads, slots), dtype) for name, dtype in BOOKKEEPING.items()}


def scatter_heads(buffer: jax.Array, update: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
  """Writes update [B, K, T, ...] into buffer [B, K, ...] at slots int[B, K, T] along `axis`;
  slots at the buffer's size are dropped (padding)."""
  index = [slice(None)] * buffer.ndim
  index[0] = jnp.arange(buffer.shape[0])[:, None, None]
  index[1] = jnp.arange(buffer.shape[1])[None, :, None]
  index[axis] = slots
  return buffer.at[tuple(index)].set(update.astype(buffer.dtype), mode="drop")


@register("evict")
class EvictedCache(ContiguousCache):
  """Per row and kv head of each global layer, `slots` (static) tokens chosen by `press` (static;
  its compression ratio and head budgets too); each windowed layer a ring of min(max_len, window +
  sinks) positions; see the module docstring. max_len (static) bounds the positions a
  row may reach.

  budget: int32 scalar, the slots a row may fill when `slots` (the storage) was made larger (a
  bucket): the slots past it stay empty and are never written, so the cache keeps and evicts the
  tokens a cache of `budget` slots would; None, all the slots. A leaf, like `limit`.
  """

  budget: jax.Array | None = None
  slots: int = flax.struct.field(pytree_node=False, default=0)
  press: Press | None = flax.struct.field(pytree_node=False, default=None)
  num_layers: int = flax.struct.field(pytree_node=False, default=1)  # the model's, for per-layer budgets

  @property
  def adaptive(self) -> bool:
    """Whether heads of a row keep different numbers of tokens (AdaKV's budgets, KVzip's)."""
    return self.press.uneven_heads

  @classmethod
  def rows(
    cls,
    config: ModelConfig,
    batch: int,
    max_len: int,
    cache_config: CacheConfig,
    prompt: int | None = None,
    bucket: bool = False,
  ) -> "EvictedCache":
    """An empty cache of `batch` rows for max_len positions whose first call is `prompt` tokens
    (default max_len): slots_for(...) slots per row and kv head of each global layer. With `bucket`, the storage is
    rounded up (size_bucket: max_len positions, the slots), `limit` and `budget` keep the asked."""
    check_positive_int(batch, "batch")
    check_positive_int(max_len, "max_len")
    check_model(config, cache_config)
    model = cache_config.model(config)
    model.check_length(max_len, f"a cache of max_len={max_len} positions")
    budget = slots_for(cache_config, max_len, prompt)
    press = cache_config.press
    if press.decode_budget and press.decode_budget < press.min_slots:
      raise ValueError(
        f"{type(press).__name__}.decode_budget={press.decode_budget} is smaller than the {press.min_slots} tokens "
        f"{press!r} always keeps"
      )
    if budget < press.min_slots:
      raise ValueError(
        f"the evicting cache's budget of {budget} slots (max_len={max_len}) is smaller than the "
        f"{press.min_slots} tokens {press!r} always keeps"
      )
    if budget < 1:
      raise ValueError(f"the evicting cache's budget is {budget} slots (max_len={max_len}); it needs one at least")
    if not bucket:
      return cls.empty(config, batch, max_len, budget, cache_config, press)
    storage = size_bucket(max_len, model.max_positions)
    cache = cls.empty(config, batch, storage, size_bucket(budget, storage), cache_config, press)
    return cache.replace(limit=jnp.asarray(max_len, jnp.int32), budget=jnp.asarray(budget, jnp.int32))

  @classmethod
  def empty(
    cls, config: ModelConfig, batch: int, max_len: int, slots: int, cache_config: CacheConfig, press: Press
  ) -> "EvictedCache":
    """An empty cache of `slots` slots per row and kv head, for max_len positions."""
    memory.check_fits(
      f"an evicting cache of {batch} rows x {slots} slots",
      batch * cls.row_bytes(config, cache_config, max_len, slots) + 4 * batch,
    )
    statics = cls.statics(config, cache_config)
    model = cache_config.model(config)

    def layer(i):
      return {
        name: jnp.full(shape, -1, dtype) if name == "positions" else jnp.zeros(shape, dtype)
        for name, (shape, dtype) in layer_spec(model, statics["codec"], batch, i, max_len, slots).items()
      }

    return cls(
      layers=cache_collection(config, layer),
      lengths=jnp.zeros((batch,), jnp.int32),
      max_len=max_len,
      slots=slots,
      press=press,
      num_layers=config.num_layers,
      **statics,
    )

  @classmethod
  def create(cls, config, batch, max_len, cache_config=CacheConfig(), prompt=None) -> "EvictedCache":
    return cls.rows(config, batch, max_len, cache_config, prompt)

  @classmethod
  def sequence_bytes(cls, config: ModelConfig, cache_config: CacheConfig, length: int, prompt: int | None = None):
    """Bytes one row of a cache for `length` positions and a `prompt`-token first call takes."""
    return cls.row_bytes(config, cache_config, length, slots_for(cache_config, length, prompt))

  @classmethod
  def row_bytes(cls, config: ModelConfig, cache_config: CacheConfig, max_len: int, slots: int) -> int:
    """Bytes of one row's layers: each global layer's `slots` (K/V through the codec and the
    bookkeeping), each windowed layer's ring of min(max_len, window + sinks) positions."""
    model = cache_config.model(config)
    slot, position = cls.slot_bytes(config, cache_config), cls.position_bytes(config, cache_config)
    return sum(
      model.cached_positions(i, max_len) * position if model.layer_window(i) else slots * slot
      for i in range(config.num_layers)
    )

  @classmethod
  def slot_bytes(cls, config: ModelConfig, cache_config: CacheConfig) -> int:
    """Bytes of one slot of one layer: K/V through the codec and the bookkeeping of every kv head."""
    return cls.position_bytes(config, cache_config) + config.num_kv_heads * sum(
      d.itemsize for d in BOOKKEEPING.values()
    )

  @classmethod
  def bytes_for(cls, config, cache_config, batch, max_len, prompt=None) -> int:
    return batch * cls.sequence_bytes(config, cache_config, max_len, prompt) + 4 * batch

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    return layer_spec(config, self.codec, self.lengths.shape[0], layer, self.max_len, self.slots)

  @property
  def ring(self) -> ContiguousCache:
    """The contiguous layout over the same arrays: what writes and reads the windowed layers' rings."""
    return ContiguousCache(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ContiguousCache)})

  def filled(self, stored: dict) -> jax.Array:
    """int[B]: the slots row b holds (every head of a row holds as many, slots 0, 1, ... first)."""
    return (stored["positions"][:, 0] >= 0).sum(axis=-1, dtype=jnp.int32)

  @property
  def room(self) -> int:
    """Slots a row may fill (the budget, when the storage is a bucket's)."""
    return self.slots if self.budget is None else int(self.budget)

  def first_call(self, model, params, tokens, lengths, logits_at=None):
    """A model-level press's prefill (KVzip's reconstruction, kvjax.cache.kvzip); None otherwise."""
    return self.press.prefill(model, params, self, tokens, lengths, logits_at) if self.press.model_level else None

  def check_room(self, new_lengths: np.ndarray) -> None:
    super().check_room(new_lengths)  # positions up to max_len
    if np.asarray(self.lengths).any() and int(np.max(new_lengths, initial=0)) > self.room:  # a prompt is pressed
      row = int(np.argmax(new_lengths))
      raise ValueError(
        f"row {row} brings {int(new_lengths[row])} tokens in one call, more than the evicting cache's "
        f"{self.room} slots; split the call"
      )

  def usable(self) -> jax.Array:
    """bool[S]: the slots a row may fill (traced; all of them without a budget)."""
    slots = jnp.arange(self.slots)
    return slots >= 0 if self.budget is None else slots < self.budget

  # Device side.

  def compress(
    self,
    new: dict,
    q: jax.Array,
    span: Span,
    rope: Rope | None = None,
    scores: jax.Array | None = None,
    out: jax.Array | None = None,
  ) -> dict:
    """A layer's arrays holding the tokens the press keeps of a prompt: new {k, v} [B, K, T, H]
    at positions 0..T-1, q [B, T, N, H] every column's queries, rope the layer's (a press may
    un-rotate q); layer span.layer keeps selection.counts of each row's tokens. `scores` float32
    [B, K, T]: the press's prompt_scores when already computed (kvjax.cache.layouts.fanout shares them
    between presses of one scorer)."""
    if scores is None:
      scores = self.press.prompt_scores(q, new["k"], new["v"], span.lengths, rope, out)
    scores = jnp.where(span.valid[:, None], scores.astype(jnp.float32), -jnp.inf)
    room = self.usable().sum(dtype=jnp.int32)
    scores, counts = selection.choose(self.press, scores, span.lengths, span.layer, self.num_layers, room)
    return self.keep(new, scores, counts, span.positions)

  def keep(self, new: dict, scores: jax.Array, counts: jax.Array, positions: jax.Array) -> dict:
    """A global layer's arrays holding, per row and kv head, the counts int[B, K] best-scoring
    tokens of new {k, v} [B, K, T, H] at positions int[B, T] (scores float32 [B, K, T], -inf:
    padding), best first in slots 0, 1, ... (kvjax.cache.selection.best_first)."""
    order, chosen, positions = selection.gather_best(new, scores, positions, self.slots)  # [B, K, S(, H)]
    held = jnp.arange(self.slots)[None, None, :] < counts[:, :, None]
    stored = {"positions": jnp.where(held, positions, -1), "scores": jnp.take_along_axis(scores, order, axis=-1)}
    for name, x in encode(self.codec, chosen).items():
      transposed = self.fields[name.removesuffix("_scale")].transposed
      stored[name] = x.swapaxes(2, 3) if transposed and x.ndim == 4 else x
    return stored

  def write(self, stored, new, span: Span):
    """A windowed layer's tokens to its ring (`ring`); a global layer's, each valid new token to an empty slot (lowest first) or, in a full row, to the slot of the
    lowest-scoring token held; the call's own tokens all enter (a chunk fits the slots: check_room)."""
    if span.window.size:
      return self.ring.write(stored, new, span)
    t = span.positions.shape[1]
    priority = jnp.where(stored["positions"] < 0, -jnp.inf, stored["scores"])  # [B, K, S]
    # Slots past the budget rank with the tokens scored +inf (a press's always-kept ones), after
    # them by slot, so they are taken only where no cache of `budget` slots would have a victim.
    priority = jnp.where(self.usable(), priority, jnp.inf)
    # [B, K, min(T, S)]: empties first (lowest slot), then the worst held. A call's valid columns
    # fit the slots (check_room), so the columns past S, if any, are padding.
    victims = jax.lax.top_k(-priority, min(t, self.slots))[1]
    victims = jnp.pad(victims, ((0, 0), (0, 0), (0, t - victims.shape[-1])), constant_values=self.slots)
    slots = jnp.where(span.valid[:, None], victims, self.slots)
    arrivals = {
      "positions": jnp.broadcast_to(span.positions[:, None], slots.shape),
      "scores": self.press.arrival_scores(new["k"], span.positions),
    }
    out = {}
    for name, x in (encode(self.codec, new) | arrivals).items():  # [B, K, T, ...]
      transposed = name not in BOOKKEEPING and self.fields[name.removesuffix("_scale")].transposed
      axis = stored[name].ndim - 1 if transposed or name in BOOKKEEPING or x.ndim == 3 else 2
      out[name] = scatter_heads(stored[name], x, slots, axis)
    return out

  def read(self, stored, query, q_positions, span: Span, backend: Backend):
    if span.window.size:
      return self.ring.read(stored, query, q_positions, span, backend)
    contiguous = not self.adaptive and not self.press.decode_budget  # a budget leaves holes (kvjax.cache.selection)
    if q_positions.shape[1] == 1 and query.kernel_query is not None and contiguous:
      return backend.cache_attention(
        ("contiguous", self.codec.name),
        query.kernel_query,
        stored["k"],
        stored["v"],
        self.filled(stored) - 1,
        functools.partial(attend_one, codec=self.codec),
        **self.scales(stored),
      )
    keys = Visibility(q_positions, stored["positions"], span.window)  # per kv head
    return query.attend(self.readable(stored), keys, transposed=True, backend=backend)

  def attend(self, stored, query, q_positions, new, span: Span, backend: Backend):
    if span.window.size:  # a windowed layer: its ring, never pressed
      return self.ring.attend(stored, query, q_positions, new, span, backend)
    if span.from_empty:
      out = query.attend(self.as_stored(new), new_keys(q_positions, span), backend=backend)
      return self.compress(new, query.every_q, span, query.rope, out=query.out), out
    stored = self.write(stored, new, span)
    out = self.read(stored, query, q_positions, span, backend)
    return (self.press_to_budget(stored, query, span) if self.press.decode_budget else stored), out

  def press_to_budget(self, stored: dict, query, span: Span) -> dict:
    """A global layer's arrays after a call under the press's decode budget (kvjax.cache.selection):
    the held scores updated by the press's decode-time rule, the row pressed back to the budget."""
    scores = stored["scores"]
    if self.press.reads_attention:
      mask = Visibility(span.positions, stored["positions"], span.window).mask() & span.valid[:, None, :, None]
      weights = attention_weights(query.every_q, self.readable(stored)["k"], mask, transposed=True)
      new = stored["positions"] >= span.positions[:, :1, None]  # [B, K, S]: this call's slots
      scores = self.press.held_scores(scores, weights, span.valid, new)
    budget = self.press.decode_budget
    full = jnp.minimum(self.usable().sum(dtype=jnp.int32), budget + self.press.decode_interval)
    several = span.positions.shape[1] > 1
    positions = selection.press_to_budget(stored["positions"], scores, full, budget, several)
    return stored | {"positions": positions, "scores": scores}

  def resized(self, capacity: int):
    raise ValueError("an evicting cache keeps its slots; it is not resized")
