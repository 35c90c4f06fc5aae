"""The engine's device side (kvjax.serving.engine): the model, its params and the cache's page pools.

The engine schedules requests; a `Runner` turns each of its decisions into one jitted call
(kvjax.serving.steps, kvjax.serving.mixed): a request's prefill or extension into its pages, the
decode step of every row, the mixed step of both, and the per-row sampler. Rows are passed as the
engine holds them (a Request, or None for an idle row); the runner reads their pages from the
allocator and their positions from their tokens. The shapes it passes are bucketed (prompt
buckets, page-table widths, chunk widths), so the engine compiles a bounded number of functions,
all of them in `warmup`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import kinds
from kvjax.cache.layouts.paged_evict import held_slots
from kvjax.decoding.decode import for_decoding, size_bucket
from kvjax.model.transformer import Transformer
from kvjax.model.weights import store
from kvjax.serving import mixed, steps
from kvjax.serving.allocator import PageAllocator
from kvjax.serving.config import EngineConfig
from kvjax.serving.requests import Request

GREEDY = (0.0, 0, 1.0)


class Runner:
  """The jitted calls of an engine over `config`'s page pool, for contexts of at most `max_len`
  positions; `allocator` holds the pages of every request."""

  def __init__(self, model: Transformer, params, config: EngineConfig, allocator: PageAllocator, max_len: int):
    self.model, self.params, self.config = for_decoding(model), store(params, config.weights), config
    self.allocator, self.max_len, self.press = allocator, max_len, config.cache.press
    self.max_pages = allocator.pages_for(max_len)
    self.cache = kinds.kind(config.cache).create(
      model.config, config.num_pages, config.cache.page_size, config.num_slots, self.max_pages, config.cache
    )

  def held(self, prompt: int, generated: int) -> int:
    """Tokens (slots) a request of a `prompt`-token prompt and `generated` tokens holds in its
    pages: every one, or with a press the prompt's kept ones and every generated one (at most the
    decode budget's capacity)."""
    return prompt + generated if self.press is None else held_slots(prompt, generated, self.press)

  # Shapes.

  def width(self, positions: int) -> int:
    """Page-table columns a decode step reads to cover `positions` positions: attention gathers
    and reads only these pages, and bucketing them bounds the number of compilations."""
    floor = self.allocator.pages_for(steps.MIN_PROMPT_BUCKET)
    return size_bucket(self.allocator.pages_for(positions), self.max_pages, floor)

  def mixed_width(self, positions: int) -> int:
    """Page-table columns of a mixed call covering `positions`: a power of two (at most max_pages),
    so that with the chunk's width the call compiles for few shapes."""
    return min(self.max_pages, 1 << (self.allocator.pages_for(positions) - 1).bit_length())

  @staticmethod
  def chunk_bucket(tokens: int) -> int:
    """Columns of a mixed call's chunk of `tokens` (a power of two, or fewer than
    MIN_PROMPT_BUCKET): at least MIN_PROMPT_BUCKET."""
    return max(steps.MIN_PROMPT_BUCKET, 1 << (tokens - 1).bit_length())

  # Calls.

  def prefill(self, context: np.ndarray, table, columns: int = 0) -> jax.Array:
    """One request's first tokens `context` int[L] into its empty pages -> logits [1, V]; the
    call is padded to the prompt bucket of L (of `columns`, when more)."""
    cache = self.cache.with_rows(table, np.zeros(1, np.int32), np.zeros(1, np.int32))
    tokens = steps.padded(context, self.max_len, columns)
    logits, self.cache = steps.prefill(self.model, self.params, cache, jnp.asarray(tokens), jnp.array([context.size]))
    return logits

  def extend(self, context: np.ndarray, table, position: int, filled: int, columns: int = 0) -> jax.Array:
    """`context` int[L], the tokens after a request's `position` positions held in `filled`
    slots -> logits [1, V]; padded as `prefill`."""
    cache = self.cache.with_rows(table, np.array([position], np.int32), np.array([filled], np.int32))
    tokens = steps.padded(context, self.max_len, columns)
    logits, self.cache = steps.extend(self.model, self.params, cache, jnp.asarray(tokens), jnp.array([context.size]))
    return logits

  def recompute(self, context: np.ndarray, first: int, table) -> jax.Array:
    """A preempted request's generated tokens context[first:] after its pressed prompt -> the last
    one's logits [1, V]: one call, or under a decode budget one call per token (the row is pressed
    as it was when it decoded them)."""
    if not self.press.decode_budget:
      return self.extend(context[first:], table, first, self.held(first, 0))
    for i in range(first, context.size):
      logits = self.extend(context[i : i + 1], table, i, self.held(first, i - first))
    return logits

  def pick(self, logits, rows: list[Request | None]) -> np.ndarray:
    """Each row's next token from its logits [B, V] under its sampling (an idle row greedily)."""
    return np.asarray(
      steps.pick(
        logits,
        steps.stack_sampling([GREEDY if r is None else r.sampling for r in rows]),
        self.config.seed,
        jnp.asarray([0 if r is None else r.id for r in rows], jnp.int32),
        jnp.asarray([0 if r is None else len(r.generated) for r in rows], jnp.int32),
      )
    )

  def decode(self, slots: list[Request | None], width: int) -> np.ndarray:
    """One decode step over all rows, reading `width` page-table columns -> each row's next
    token; a request's pages already hold the slot it writes."""
    rows = self._rows(slots)
    table = self.allocator.page_table(rows["ids"], self.max_pages)[:, :width]
    cache = self.cache.with_rows(table, rows["lengths"], rows["filled"])
    logits, self.cache = steps.decode(self.model, self.params, cache, jnp.asarray(rows["tokens"]))
    return self.pick(logits, slots)

  def mixed(self, slots: list[Request | None], request: Request | None, chunk, width: int) -> np.ndarray:
    """One mixed call: every row's decode token (None: idle) and `chunk` int[C'] of `request`'s
    context after what its pages hold (None: an idle chunk row) -> each row's next token, then the
    chunk's."""
    rows = self._rows(slots)
    padded = np.zeros((1, self.chunk_bucket(chunk.size)), np.int32)
    padded[0, : chunk.size] = chunk
    ids = rows["ids"] + [None if request is None else request.id]
    table = self.allocator.page_table(ids, self.max_pages)[:, :width]
    start = 0 if request is None else request.computed
    cache = self.cache.with_rows(table, np.append(rows["lengths"], start))
    logits, self.cache = mixed.step(
      self.model, self.params, cache, jnp.asarray(rows["tokens"]), jnp.asarray(padded), jnp.array([chunk.size])
    )
    return self.pick(logits, slots + [request])

  def warmup(self, extends: bool) -> None:
    """Compiles every prompt bucket (and when `extends`, every extension bucket: a context after
    cached pages, or a pressed recompute), page-table width, mixed call (chunk bucket by the widths
    its chunk can reach) and sampler on idle rows (writes land in the null page)."""
    idle_table = np.zeros((1, self.max_pages), np.int32)
    one = np.zeros(1, np.int32)  # one token padded to each bucket: the bucket's shape, little to compute
    n = steps.MIN_PROMPT_BUCKET
    while True:
      bucket = size_bucket(n, self.max_len, steps.MIN_PROMPT_BUCKET)
      self.pick(self.prefill(one, idle_table, bucket), [None])
      if extends:
        self.extend(one, idle_table, 1, 0, bucket)
      if bucket >= self.max_len:
        break
      n = bucket + 1
    idle = [None] * self.config.num_slots
    width = self.width(1)
    while True:
      self.decode(idle, width)
      if width >= self.max_pages:
        break
      width = self.width(width * self.config.cache.page_size + 1)
    if not self.config.mixed_steps or self.press is not None:
      return
    widest = 1 << (min(self.config.prefill_chunk or self.max_len, self.max_len).bit_length() - 1)
    bucket = steps.MIN_PROMPT_BUCKET
    while True:  # a chunk wider than the smallest bucket fills it, so needs that many positions
      least = 1 if bucket == steps.MIN_PROMPT_BUCKET else bucket
      width = self.mixed_width(least)
      while True:
        self.mixed(idle, None, np.zeros(least, np.int32), width)
        if width >= self.max_pages:
          break
        width = self.mixed_width(width * self.config.cache.page_size + 1)
      if bucket * 2 > widest:
        break
      bucket *= 2

  def _rows(self, slots: list[Request | None]) -> dict:
    """A decode step's rows (None: idle) -> their ids, the positions each holds before its token
    (lengths), the slots it fills (filled), and the tokens they take."""
    return dict(
      ids=[None if r is None else r.id for r in slots],
      lengths=np.array([0 if r is None else r.prompt.size + len(r.generated) - 1 for r in slots], np.int32),
      filled=np.array([0 if r is None else self.held(r.prompt.size, len(r.generated) - 1) for r in slots], np.int32),
      tokens=np.array([0 if r is None else r.generated[-1] for r in slots], np.int32),
    )
