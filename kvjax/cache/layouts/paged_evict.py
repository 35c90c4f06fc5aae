"""The paged evicting layout: a press's kept tokens in pages, their positions beside them.

The continuous-batching engine (kvjax.serving.engine) keeps each request's pressed prompt in as
many pages as the kept tokens need, so one page pool serves more long prompts at once. A row's
pages hold its slots 0, 1, ... in order (slot j in page j // Z at offset j % Z, as the paged
layout holds positions), and each slot carries the position of the token it holds, per kv head:
a press keeps different tokens in different heads (kvjax.cache.layouts.evict's rule).

Per layer, beside the paged layout's pools (kvjax.cache.layouts.paged: [K, P, Z, W'] and the codec's
scales):
  positions  int32[K, P, Z], the position the slot holds in that kv head.
Per row, beside lengths (the positions seen, which place the next token and turn RoPE):
  filled     int32[B], the slots the row holds (every head holds as many).

The first call from an empty cache (the prompt) attends over all its tokens, then each layer's
press keeps row b's int(n_b * (1 - ratio)) best tokens, best first, in slots [0, kept): the
tokens, their order and so every later read are those of the evicting layout (kvjax.cache.layouts.evict)
for the same press. Later tokens (decode, or the generated tokens a preempted request
recomputes) take the next slots; without a decode budget nothing is evicted after the prompt, so
the row grows by pages as a paged row does, and the evicting layout's cache of kept + generated
slots keeps the same tokens. A one-token read goes through the paged decode route over slots
[0, filled]; a longer one gathers the pages and masks by the per-head positions.

Under a decode budget (the press's decode_budget and decode_interval, kvjax.cache.selection) a
row holds at most budget + interval slots (`capacity`), whatever it generates: each slot also
carries its score (float32[K, P, Z]), a new token goes to its head's lowest empty slot (a hole
left by a pressing, else the next), and a row that reaches budget + interval tokens drops its
lowest-scoring ones down to the budget, leaving holes (position -1): the evicting layout's rule,
slot for slot, so the same tokens in the same slots. With interval 1 every hole is filled by the
next token before it is read, so a one-token read stays on the paged decode route; with a longer
interval reads gather the pages and mask the holes.

The tokens kept are chosen as the evicting layout chooses them (kvjax.cache.selection: the
press's scores from the prompt's queries, keys, values and RoPE, the budget, best first), and
what these pages cannot hold is refused there by name (kvjax.cache.selection.refusal): MLA's
latent, sliding-window layers (a windowed layer drops tokens as it decodes, which these pages do
not), budgets that differ by head (AdaKV, KVzip) or by layer (a pyramid), a model-level press and
a chunked, pressed prefill.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import memory
from kvjax.cache import selection
from kvjax.cache.layouts import evict
from kvjax.cache.base import SCALE, encode, layer_arrays
from kvjax.cache.config import CacheConfig, register
from kvjax.cache.layouts.paged import (
  NULL_PAGE,
  PagedCache,
  attend_pages,
  check_pool,
  gather,
  layer_spec as paged_spec,
  write_addresses,
)
from kvjax.cache.presses import Press, attention_weights
from kvjax.config import ModelConfig
from kvjax.model.attention import Span, new_keys
from kvjax.model.keys import Visibility
from kvjax.model.backend import Backend
from kvjax.model.transformer import cache_collection

POSITIONS, SCORES = "positions", "scores"
DROP_PASSES = 8  # decode intervals up to this drop their tokens by passes of minima, longer ones by a sort


def layer_spec(config: ModelConfig, codec, num_pages: int, page_size: int, scored: bool = False) -> dict:
  """{name: (shape, dtype)} of one layer's pools: the paged layout's, the per-head positions and,
  under a decode budget (`scored`), the per-head scores."""
  slots = (config.num_kv_heads, num_pages, page_size)
  extra = {SCORES: (slots, jnp.dtype(jnp.float32))} if scored else {}
  return paged_spec(config, codec, num_pages, page_size) | {POSITIONS: (slots, jnp.dtype(jnp.int32))} | extra


def check_model(config: ModelConfig, cache_config: CacheConfig) -> None:
  """Raises ValueError unless a model of `config` can decode through a paged evicting cache
  (kvjax.cache.selection decides, for every evicting layout)."""
  selection.check(config, cache_config)


def kept_slots(prompt: int, press: Press) -> int:
  """Slots a prompt of `prompt` tokens holds once pressed (at most the decode budget)."""
  kept = int(selection.kept(prompt, press.compression_ratio))
  return min(kept, press.decode_budget) if press.decode_budget else kept


def capacity(press: Press) -> int | None:
  """The most slots a row holds under the press's decode budget (budget + interval); None without one."""
  return press.decode_budget + press.decode_interval if press.decode_budget else None


def held_slots(prompt: int, generated: int, press: Press) -> int:
  """Slots a row holds, or has held, after its `prompt`-token prompt and `generated` more tokens:
  the kept prompt and every later token, at most `capacity` (a pressing leaves holes below it)."""
  held = kept_slots(prompt, press) + generated
  return held if not press.decode_budget else min(held, capacity(press))


@register("paged_evict")
class PagedEvictCache(PagedCache):
  """Page pools of a press's kept tokens with their per-head positions; see the module docstring.
  filled: int32[B], the slots each row holds (lengths: the positions it has seen).
  press (static): the press that chooses the prompt's kept tokens."""

  filled: jax.Array | None = None
  press: Press | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def create(
    cls,
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    batch: int,
    max_pages: int,
    cache_config: CacheConfig,
  ) -> "PagedEvictCache":
    """Empty pools of num_pages pages of page_size slots, `batch` rows of max_pages entries."""
    check_pool(num_pages, page_size, batch, max_pages)
    check_model(config, cache_config)
    statics = cls.statics(config, cache_config)
    memory.check_fits(
      f"a paged evicting cache of {num_pages} pages x {page_size} tokens",
      cls.pool_bytes(config, cache_config, num_pages, page_size, batch, max_pages),
    )
    spec = layer_spec(config, statics["codec"], num_pages, page_size, bool(cache_config.press.decode_budget))
    return cls(
      layers=cache_collection(config, lambda i: layer_arrays(spec)),
      lengths=jnp.zeros((batch,), jnp.int32),
      filled=jnp.zeros((batch,), jnp.int32),
      page_table=jnp.zeros((batch, max_pages), jnp.int32),
      press=cache_config.press,
      **statics,
    )

  @classmethod
  def rows(cls, config, batch, max_len, cache_config, prompt=None, bucket=False):
    raise ValueError(
      "layout='paged_evict' is the engine's (kvjax.serving.engine, which allocates its pages); "
      "prefill, extend and generate press through layout='evict'"
    )

  @classmethod
  def bytes_for(cls, config, cache_config, batch, max_len, prompt=None) -> int:
    """Bytes of `batch` rows holding a `prompt`-token pressed prompt and the rest of max_len
    positions, in whole pages."""
    slots = evict.slots_for(cache_config, max_len, prompt)
    width = -(-slots // cache_config.page_size)
    return cls.pool_bytes(config, cache_config, 1 + batch * width, cache_config.page_size, batch, width)

  @classmethod
  def sequence_bytes(cls, config: ModelConfig, cache_config: CacheConfig, length: int) -> int:
    """Bytes of one slot of every layer x `length` slots: K/V through the codec, the positions and
    (under a decode budget) the scores."""
    bookkeeping = (8 if cache_config.press.decode_budget else 4) * config.num_kv_heads
    return config.num_layers * length * (cls.position_bytes(config, cache_config) + bookkeeping)

  @property
  def route(self) -> tuple[str, str]:
    return ("paged", self.codec.name)  # a decode step reads slots [0, filled] as the paged layout reads positions

  def layer_spec(self, config: ModelConfig, layer: int = 0):
    return layer_spec(config, self.codec, self.num_pages, self.page_size, bool(self.press.decode_budget))

  @property
  def capacity(self) -> int | None:
    """The most slots a row holds (module docstring); None without a decode budget."""
    return capacity(self.press)

  def with_rows(self, page_table, lengths, filled=None) -> "PagedEvictCache":
    """The same pools addressed by another batch of rows: page_table int[B', M'], lengths int[B']
    (positions each row has seen), filled int[B'] (slots each row holds in its pages)."""
    if filled is None:
      raise ValueError("a paged evicting cache's rows need `filled`, the slots each row holds")
    return self.replace(
      page_table=jnp.asarray(page_table, jnp.int32),
      lengths=jnp.asarray(lengths, jnp.int32),
      filled=jnp.asarray(filled, jnp.int32),
    )

  def check_room(self, new_lengths: np.ndarray) -> None:
    """Every slot a row will fill must be in one of its real pages (a prompt needs its kept ones)."""
    held = np.asarray(self.filled)
    empty = np.asarray(self.lengths) == 0
    kept = np.vectorize(lambda n: kept_slots(int(n), self.press), otypes=[np.int64])(new_lengths)
    needed = held + np.where(empty, kept, new_lengths)
    if self.press.decode_budget:
      needed = np.minimum(needed, self.capacity)  # holes first: a pressed row never passes its capacity
    table = np.asarray(self.page_table)
    pages = -(-needed // self.page_size)
    owned = (table != 0).sum(axis=1)
    if (pages > owned).any():
      row = int(np.argmax(pages > owned))
      raise ValueError(
        f"row {row} needs {int(needed[row])} slots, {int(pages[row])} pages of {self.page_size}, "
        f"but its page table holds {int(owned[row])}"
      )

  # Device side.

  def store(self, stored: dict, new: dict, positions: jax.Array, lengths: jax.Array, extra=None) -> dict:
    """Writes new {k, v} [B, K, T, H] (per-head tokens, positions int[B, K, T], and `extra`
    {name: [B, K, T]}, the scores) to each row's slots filled[b] + [0, lengths[b]); columns past
    lengths[b] land in the null page."""
    t = positions.shape[-1]
    slots = Span(positions=self.filled[:, None] + jnp.arange(t, dtype=jnp.int32), lengths=lengths)
    pages, offsets = write_addresses(self.page_table, slots, stored["k"].shape[2])
    out = dict(stored)
    for name, x in (encode(self.codec, new) | {POSITIONS: positions} | (extra or {})).items():  # [B, K, T, ...]
      out[name] = stored[name].at[:, pages, offsets].set(jnp.swapaxes(x, 0, 1).astype(stored[name].dtype), mode="drop")
    return out

  def store_heads(self, stored: dict, arrays: dict, slots: jax.Array) -> dict:
    """Writes arrays {name: [B, K, T, ...]} to each head's own slots int[B, K, T] of its row
    (a slot of -1, or past the page table, lands in the null page)."""
    page_size = stored["k"].shape[2]
    index = jnp.clip(slots // page_size, 0, self.page_table.shape[1] - 1)
    pages = jnp.take_along_axis(self.page_table[:, None, :], index, axis=2)  # [B, K, T]
    pages = jnp.where((slots >= 0) & (slots < self.page_table.shape[1] * page_size), pages, NULL_PAGE)
    heads = jnp.arange(slots.shape[1])[None, :, None]
    out = dict(stored)
    for name, x in arrays.items():
      out[name] = stored[name].at[heads, pages, slots % page_size].set(x.astype(stored[name].dtype), mode="drop")
    return out

  def compress(self, stored: dict, new: dict, q: jax.Array, span: Span, rope=None, out=None) -> dict:
    """The prompt's kept tokens, best first (ties: earliest), in slots [0, kept): new {k, v}
    [B, K, T, H] at span.positions, q [B, T, N, H] every column's queries, rope the layer's."""
    scores = self.press.prompt_scores(q, new["k"], new["v"], span.lengths, rope, out)
    scores = jnp.where(span.valid[:, None], scores.astype(jnp.float32), -jnp.inf)  # [B, K, T]
    scores, counts = selection.choose(self.press, scores, span.lengths, span.layer, 1)
    keep = counts[:, 0]  # [B]: every head alike
    order, chosen, positions = selection.gather_best(new, scores, span.positions, scores.shape[-1])
    extra = {SCORES: jnp.take_along_axis(scores, order, axis=-1)} if self.press.decode_budget else None
    return self.store(stored, chosen, positions, keep, extra)

  def write(self, stored, new, span: Span):
    positions = jnp.broadcast_to(span.positions[:, None], new["k"].shape[:3])  # [B, K, T]
    return self.store(stored, new, positions, span.lengths)

  def read(self, stored, query, q_positions, span: Span, backend: Backend, held=None):
    """The call's attention over the row's slots: on the paged decode route over slots [0, last]
    when they hold no hole, else gathered and masked by `held` int[B, K, S] (each slot's position,
    -1 empty; default the pages' positions up to the last slot)."""
    last = self.filled + span.lengths - 1  # [B]: the last slot each row holds after this call
    if self.capacity is not None:
      last = jnp.minimum(last, self.capacity - 1)
    holes = self.capacity is not None and self.press.decode_interval > 1
    if q_positions.shape[1] == 1 and query.kernel_query is not None and not holes:
      return backend.cache_attention(
        self.route,
        query.kernel_query,
        stored["k"],
        stored["v"],
        last,
        functools.partial(attend_pages, codec=self.codec),
        page_table=self.page_table,
        **self.scales(stored),
      )
    gathered = {name: gather(stored[name], self.page_table) for name in self.fields_of(stored)}  # [B, K, M*Z, ...]
    arrays = self.decoded(gathered, dict.fromkeys(self.fields, -1))
    if held is None:
      slots = jnp.arange(self.page_table.shape[1] * stored["k"].shape[2])[None, None, :]
      held = jnp.where(slots <= last[:, None, None], gather(stored[POSITIONS], self.page_table), -1)
    return query.attend(arrays, Visibility(q_positions, held, span.window), backend=backend)  # per kv head

  def fields_of(self, stored: dict) -> list[str]:
    """The K/V pools of a layer's arrays (and their scales): what a read gathers."""
    return [name for name in stored if name not in (POSITIONS, SCORES)]

  def attend(self, stored, query, q_positions, new, span: Span, backend: Backend):
    if span.from_empty:  # the prompt reads all of itself, then keeps what the press chooses
      out = query.attend(self.as_stored(new), new_keys(q_positions, span), backend=backend)
      return self.compress(stored, new, query.every_q, span, query.rope, query.out), out
    if self.press.decode_budget:
      return self.attend_budgeted(stored, query, q_positions, new, span, backend)
    stored = self.write(stored, new, span)
    return stored, self.read(stored, query, q_positions, span, backend)

  def attend_budgeted(self, stored, query, q_positions, new, span: Span, backend: Backend):
    """A call after the prompt under a decode budget (module docstring): each new token to its
    head's lowest empty slot, the read, then the row pressed back to the budget once it holds
    budget + interval tokens (or, for a call of several tokens, more than the budget)."""
    page_size = stored["k"].shape[2]
    width = self.page_table.shape[1] * page_size
    slot = jnp.arange(width)[None, None, :]
    mine = slot < self.filled[:, None, None]  # [B, 1, S]: the slots the row held before the call
    positions = jnp.where(mine, gather(stored[POSITIONS], self.page_table), -1)  # [B, K, S]
    scores = gather(stored[SCORES], self.page_table)
    # Victims as the evicting layout takes them: empty slots first (lowest), then the worst held.
    priority = jnp.where(positions < 0, -jnp.inf, scores)
    priority = jnp.where(slot < self.capacity, priority, jnp.inf)
    t = span.positions.shape[1]
    if t == 1:  # a decode step: the one victim (argmax takes the lowest slot of equals, as top_k)
      victims = jnp.argmax(-priority, axis=-1)[..., None]
    else:
      victims = jax.lax.top_k(-priority, min(t, width))[1]
    victims = jnp.pad(victims, ((0, 0), (0, 0), (0, t - victims.shape[-1])), constant_values=-1)
    victims = jnp.where(span.valid[:, None], victims, -1)  # [B, K, T]
    arrived = {
      POSITIONS: jnp.broadcast_to(span.positions[:, None], victims.shape),
      SCORES: self.press.arrival_scores(new["k"], span.positions),
    }
    stored = self.store_heads(stored, encode(self.codec, new) | arrived, victims)
    rows, heads = jnp.arange(victims.shape[0])[:, None, None], jnp.arange(victims.shape[1])[None, :, None]
    at = jnp.where(victims >= 0, victims, width)  # padding columns drop
    positions = positions.at[rows, heads, at].set(arrived[POSITIONS], mode="drop")
    scores = scores.at[rows, heads, at].set(arrived[SCORES], mode="drop")
    out = self.read(stored, query, q_positions, span, backend, held=positions)
    if self.press.reads_attention:
      scale = stored.get("k" + SCALE)
      scale = None if scale is None else gather(scale, self.page_table)
      keys = self.codec.decode(gather(stored["k"], self.page_table), scale, axis=-1)  # [B, K, S, H]
      mask = Visibility(span.positions, positions, span.window).mask() & span.valid[:, None, :, None]
      weights = attention_weights(query.every_q, keys, mask)
      scores = self.press.held_scores(scores, weights, span.valid, positions >= span.positions[:, :1, None])
    budget, interval = self.press.decode_budget, self.press.decode_interval
    held = (positions >= 0).sum(axis=-1)  # [B, K]
    if t == 1 and interval <= DROP_PASSES:  # a full row drops its `interval` worst, found by minima
      excess = jnp.where(held >= self.capacity, held - budget, 0)
      kept = selection.drop_lowest(positions, scores, excess, interval)
    else:  # sorting the slots, only in a call where some row is pressed
      several = (span.lengths > 1)[:, None]  # [B, 1]: a call of several tokens presses past the budget
      pressed = jnp.any(held >= self.capacity) | jnp.any(several & (held > budget))
      kept = jax.lax.cond(
        pressed,
        lambda: selection.press_to_budget(positions, scores, self.capacity, budget, several),
        lambda: positions,
      )
    every = jnp.broadcast_to(jnp.where(slot < self.capacity, slot, -1), positions.shape)
    # The scores change after the arrivals' write only where the press reads the call's attention.
    back = {POSITIONS: kept} | ({SCORES: scores} if self.press.reads_attention else {})
    return self.store_heads(stored, back, every), out
