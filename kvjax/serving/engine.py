"""Continuous batching over the paged KV cache.

`num_slots` batch rows are decoded together by one jitted step. A request is admitted to a free
row when the pages for its context are free (first come, first served); its context is computed
in chunks of at most `prefill_chunk` tokens per step after the pages of any prefix already cached
(prefix caching: the allocator finds them by digest); it leaves as soon as it finishes, freeing
its pages for the next one. A step that has both decoding rows and a context still being
computed runs them in one call (`mixed_steps`, kvjax.serving.mixed): every decoding row's token
and the next chunk of the oldest such context, packed in one row, so that a long prompt never
stalls the running rows and its products share each weight read with theirs.
When the running requests need more pages than are free, the newest is preempted: its pages are
freed and it waits to be recomputed (prefill of prompt + tokens so far) once pages free up.

A request's tokens depend only on its prompt, sampling settings and id: the random key of its
i-th token is fold_in(fold_in(key(seed), id), i). So every request completes with the tokens it
would get alone, whatever the admission order, batching or preemptions.

How much memory a request holds is the `allocation` policy, so the same engine runs the
memory baselines of the KV-memory study:
  paged:     pages for exactly the tokens cached (PagedAttention);
  doubling:  a buffer of the next power of two >= the context, doubled when full;
  max_len:   max_len positions reserved at admission (contiguous preallocation).

With a press (EngineConfig.cache = CacheConfig(layout="paged_evict", press=...)), a request's
prompt is pressed as it is prefilled and only its kept tokens stay, in as many pages as they need
(kvjax.cache.layouts.paged_evict): the allocator counts slots, not positions, so the same pool holds
about 1 / (1 - compression_ratio) times as many long prompts. Decoding appends to the request's
pages, and a preempted request recomputes by pressing its prompt again and appending its
generated tokens after it: the tokens of `generate` with the same press, which keeps every token
generated after the pressed prompt. Under the press's decode budget a request holds at most
budget + interval slots however long it generates (the row is pressed back to the budget as it
decodes), and a recomputed request appends its generated tokens one at a time, as it decoded them.
"""

from __future__ import annotations

import bisect

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import kinds
from kvjax.cache.layouts.paged_evict import capacity, held_slots
from kvjax.fields import check_positive_int
from kvjax.decoding.decode import for_decoding, size_bucket
from kvjax.decoding.sampling import Sampling
from kvjax.model.transformer import Transformer
from kvjax.model.weights import store
from kvjax.serving.allocator import OutOfPages, PageAllocator, page_digests
from kvjax.serving import mixed, steps
from kvjax.serving.config import EngineConfig
from kvjax.serving.requests import EngineStats, Request

GREEDY = (0.0, 0, 1.0)


class Engine:
  """Continuous-batching generation: `submit` requests, then `step` or `run`."""

  def __init__(self, model: Transformer, params, config: EngineConfig = EngineConfig()):
    cfg = model.config
    self.model, self.params, self.config = for_decoding(model), store(params, config.weights), config
    self.max_len = config.max_len or cfg.max_len
    if self.max_len > cfg.max_len:
      raise ValueError(f"EngineConfig.max_len={self.max_len} exceeds ModelConfig.max_len={cfg.max_len}")
    self.allocator = PageAllocator(config.num_pages, config.cache.page_size)
    self.max_pages = self.allocator.pages_for(self.max_len)
    self.press = config.cache.press
    # A pressed prompt's pages hold what the press kept of the whole prompt: no prefix of them is shareable.
    self.prefix_caching = config.prefix_caching and self.press is None
    self.cache = kinds.kind(config.cache).create(
      cfg, config.num_pages, config.cache.page_size, config.num_slots, self.max_pages, config.cache
    )
    self.waiting: list[Request] = []  # by id: preempted requests go back in arrival order
    self.slots: list[Request | None] = [None] * config.num_slots
    self.finished: dict[int, Request] = {}
    self.stats = EngineStats()
    self._next_id = 0

  # Public API.

  def submit(self, prompt, max_new_tokens: int, sampling: Sampling | None = None) -> int:
    """Queues a request; returns its id. prompt int[L]; sampling defaults to greedy."""
    prompt = np.asarray(prompt)
    vocab = self.model.config.vocab_size
    if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer) or prompt.size == 0:
      raise ValueError(f"prompt must be a non-empty 1-D integer array, got {prompt.dtype}{list(prompt.shape)}")
    if ((prompt < 0) | (prompt >= vocab)).any():
      pos = int(np.argmax((prompt < 0) | (prompt >= vocab)))
      raise ValueError(f"token id {int(prompt[pos])} at position {pos} is outside [0, vocab_size={vocab})")
    check_positive_int(max_new_tokens, "max_new_tokens")
    longest = prompt.size + max_new_tokens - 1
    if longest > self.max_len:
      raise ValueError(
        f"prompt of {prompt.size} tokens + max_new_tokens={max_new_tokens} needs {longest} "
        f"cache positions, more than max_len={self.max_len}"
      )
    peak = self.allocator.pages_for(self._target(self._held(prompt.size, longest - prompt.size), 0))
    if peak > self.allocator.num_usable:
      raise ValueError(
        f"the request needs up to {peak} pages under allocation={self.config.allocation!r} "
        f"but the pool has {self.allocator.num_usable}"
      )
    if sampling is None:
      settings = GREEDY
    elif isinstance(sampling, Sampling):
      settings = (float(sampling.temperature), int(sampling.top_k), float(sampling.top_p))
    else:
      raise ValueError(f"sampling must be a kvjax.Sampling or None, got {type(sampling).__name__}")
    request = Request(self._next_id, prompt.astype(np.int32), max_new_tokens, settings)
    self._next_id += 1
    self.waiting.append(request)
    return request.id

  @property
  def running(self) -> list[Request]:
    """The requests holding a row: prefilling or decoding."""
    return sorted((r for r in self.slots if r is not None), key=lambda r: r.id)

  def step(self) -> list[Request]:
    """Admits what fits; computes up to `prefill_chunk` context tokens of the rows still
    prefilling, oldest first (a row whose context is complete samples its first token); then
    decodes one token for every row that has one. Returns the requests that finished."""
    finished: list[Request] = []
    self._admit()
    if self._mixes():
      self._grow()  # may preempt the context being computed
      if self._mixes():
        self._mixed(finished)
        return finished
    self._prefill(finished)
    self._grow()
    if any(r.decoding for r in self.running):
      self._decode(finished)
    return finished

  def run(self) -> dict[int, np.ndarray]:
    """Steps until no request is left; returns every finished request's tokens by id."""
    while self.waiting or self.running:
      idle, prefills = not self.running, self.stats.prefills
      self.step()
      if idle and self.stats.prefills == prefills:
        raise RuntimeError(f"request {self.waiting[0].id} cannot be admitted into an idle engine")
    return {i: np.asarray(r.generated, np.int32) for i, r in sorted(self.finished.items())}

  def cancel(self, request_id: int) -> bool:
    """Drops a waiting or running request, freeing its pages; it never finishes. Returns False
    when no such request is waiting or running (unknown, finished or already cancelled)."""
    for i, request in enumerate(self.waiting):
      if request.id == request_id:
        del self.waiting[i]
        return True
    for request in self.running:
      if request.id == request_id:
        self._leave(request)
        return True
    return False

  def warmup(self) -> None:
    """Compiles every prompt bucket (and with a press, every extend bucket), page-table width,
    mixed call (chunk bucket by the widths its chunk can reach) and sampler on idle rows (writes
    land in the null page)."""
    n = steps.MIN_PROMPT_BUCKET
    while True:
      bucket = size_bucket(n, self.max_len, steps.MIN_PROMPT_BUCKET)
      idle = np.zeros((1, self.max_pages), np.int32)
      self._pick(self._run_prefill(np.zeros((1, bucket), np.int32), 1, idle), [None])
      if self.press is not None or self.prefix_caching:  # a context after cached pages, or a pressed recompute
        self._run_extend(np.zeros((1, bucket), np.int32), 1, idle, 1, 0)
      if bucket >= self.max_len:
        break
      n = bucket + 1
    width = self._width(1)
    while True:
      self._run_decode([None] * self.config.num_slots, width)
      if width >= self.max_pages:
        break
      width = self._width(width * self.config.cache.page_size + 1)
    if not self.config.mixed_steps or self.press is not None:
      return
    idle = [None] * self.config.num_slots
    widest = 1 << (min(self.config.prefill_chunk or self.max_len, self.max_len).bit_length() - 1)
    bucket = steps.MIN_PROMPT_BUCKET
    while True:  # a chunk wider than the smallest bucket fills it, so needs that many positions
      least = 1 if bucket == steps.MIN_PROMPT_BUCKET else bucket
      width = self._mixed_width(least)
      while True:
        self._run_mixed(idle, None, np.zeros(least, np.int32), width)
        if width >= self.max_pages:
          break
        width = self._mixed_width(width * self.config.cache.page_size + 1)
      if bucket * 2 > widest:
        break
      bucket *= 2

  # Memory policy.

  def _held(self, prompt: int, generated: int) -> int:
    """Tokens (slots) a request of a `prompt`-token prompt and `generated` tokens holds in its
    pages: every one, or with a press the prompt's kept ones and every generated one (at most the
    decode budget's capacity)."""
    return prompt + generated if self.press is None else held_slots(prompt, generated, self.press)

  def _target(self, tokens: int, capacity: int) -> int:
    """Token capacity the allocation policy holds for `tokens` cached, given `capacity` now."""
    policy = self.config.allocation
    if policy == "paged":
      return tokens
    if policy == "max_len":
      return self.max_len
    return min(self.max_len, max(capacity, 1 << max(0, tokens - 1).bit_length()))

  def _growth(self, request: Request) -> int:
    """Pages the request's next decode step will add."""
    alloc = self.allocator
    length, held = alloc.length(request.id), len(alloc.pages(request.id))
    if self.press is not None and length >= (capacity(self.press) or length + 1):  # a decode budget's full row
      return 0
    return max(0, alloc.pages_for(self._target(length + 1, alloc.capacity(request.id))) - held)

  def _width(self, positions: int) -> int:
    """Page-table columns a decode step reads to cover `positions` positions: attention gathers
    and reads only these pages, and bucketing them bounds the number of compilations."""
    floor = self.allocator.pages_for(steps.MIN_PROMPT_BUCKET)
    return size_bucket(self.allocator.pages_for(positions), self.max_pages, floor)

  # Scheduling.

  def _admit(self) -> None:
    alloc = self.allocator
    while self.waiting and None in self.slots:
      request = self.waiting[0]
      context = request.context
      held = self._held(request.prompt.size, len(request.generated))
      # A pressed prompt is pressed alone and the tokens generated before a preemption follow it,
      # as generate keeps them; without a press the whole context is one prefill, after the pages
      # of its prefix already cached (all but the last token's page: its logits must be computed).
      first = request.prompt.size if self.press is not None else context.size
      digests = page_digests(context[:first], alloc.page_size) if self.prefix_caching else []
      shared = alloc.prefix(digests[: (first - 1) // alloc.page_size])
      pages = alloc.pages_for(self._target(held, 0))
      # Admit only if the next decode step can still grow every running request (this one too,
      # unless its prefill yields its last token): otherwise the newcomer would be preempted
      # right after its prefill. Shared pages that others hold cost nothing.
      if len(request.generated) + 1 < request.max_new_tokens:
        pages = alloc.pages_for(self._target(held + 1, pages * alloc.page_size))
      taken = pages - sum(alloc.refcount(page) > 0 for page in shared)
      if taken + sum(map(self._growth, self.running)) > alloc.num_free:
        return
      self.waiting.pop(0)
      alloc.allocate(request.id, held, prefix=digests[: len(shared)])
      alloc.reserve(request.id, self._target(held, 0))
      request.slot = self.slots.index(None)
      self.slots[request.slot] = request
      request.computed, request.first, request.digests = len(shared) * alloc.page_size, first, digests
      self.stats.prefills += 1
      self.stats.prompt_tokens += first
      self.stats.cached_tokens += request.computed

  def _prefill(self, finished: list[Request], budget: int = 0) -> None:
    """Spends the step's budget of context tokens (or what a mixed call left of it) on the rows
    still prefilling, oldest first, a call each. A pressed prompt is computed whole (its press
    scores the whole prompt) and the tokens generated before a preemption follow it, as generate
    keeps them."""
    budget = budget or self.config.prefill_chunk or self.max_len
    alloc = self.allocator
    for request in self.running:
      if request.computed >= request.first:  # decoding
        continue
      if budget <= 0:
        break
      context = request.context
      start, first = request.computed, request.first
      end = first if self.press is not None else min(first, start + budget)
      table = alloc.page_table([request.id], self.max_pages)
      if start == 0:
        logits = self._run_prefill(steps.padded(context[:end], self.max_len), end, table)
      else:
        logits = self._run_extend(steps.padded(context[start:end], self.max_len), end - start, table, start, start)
      request.computed, budget = end, budget - (end - start)
      if end < first:
        continue
      alloc.cache(request.id, request.digests)  # its whole pages are written: later prompts may share them
      if first < context.size:
        logits = self._recompute(context, first, table)
        request.computed = context.size
      token = self._pick(logits, [request])
      self._emit(request, int(token[0]), finished)

  def _grow(self) -> None:
    """Makes room for one more token per decoding request, oldest first, preempting the newest."""
    for request in self.running:
      while request.decoding:
        alloc = self.allocator
        if alloc.length(request.id) >= self._held(request.prompt.size, len(request.generated)):
          break  # a full row under a decode budget: the token fills a hole the last pressing left
        try:
          alloc.reserve(request.id, self._target(alloc.length(request.id) + 1, alloc.capacity(request.id)))
          alloc.append(request.id, 1)
          break
        except OutOfPages:
          self._preempt(self.running[-1])

  def _leave(self, request: Request) -> None:
    """A running request's pages freed and its row emptied."""
    self.allocator.free(request.id)
    self.slots[request.slot] = None
    request.slot = None

  def _preempt(self, request: Request) -> None:
    self._leave(request)
    request.preemptions += 1
    self.stats.preemptions += 1
    bisect.insort(self.waiting, request, key=lambda r: r.id)

  def _emit(self, request: Request, token: int, finished: list[Request]) -> None:
    request.generated.append(token)
    self.stats.generated_tokens += 1
    if len(request.generated) == request.max_new_tokens or token in self.config.stop_ids:
      self._leave(request)
      self.finished[request.id] = request
      finished.append(request)

  def _mixes(self) -> bool:
    """Whether this step runs as one mixed call: decoding rows and a context still to compute,
    without a press (a pressed prompt is pressed whole, in a call of its own)."""
    running = self.running
    return (
      self.config.mixed_steps
      and self.press is None
      and any(r.decoding for r in running)
      and any(r.computed < r.first for r in running)
    )

  def _mixed(self, finished: list[Request]) -> None:
    """Every decoding row's next token and the next chunk of the oldest context still being
    computed, in one call; the context's first token is sampled when its chunk ends it. The chunk
    is the most of the step's budget (prefill_chunk) that a power of two of tokens takes, so no
    column of it is padding unless fewer than MIN_PROMPT_BUCKET are left; what it leaves of the
    budget goes to the contexts still being computed, a call each (`_prefill`)."""
    alloc = self.allocator
    request = next(r for r in self.running if r.computed < r.first)
    start = request.computed
    budget = self.config.prefill_chunk or self.max_len
    take = min(request.first - start, budget)
    if take > steps.MIN_PROMPT_BUCKET:
      take = 1 << (take.bit_length() - 1)
    end = start + take
    running = self._count_step()
    rows = [r if r is not None and r.decoding else None for r in self.slots]
    positions = max(end, max(alloc.length(r.id) for r in running))
    tokens = self._run_mixed(rows, request, request.context[start:end], self._mixed_width(positions))
    self.stats.mixed_steps += 1
    request.computed = end
    for r in running:
      self._emit(r, int(tokens[r.slot]), finished)
    if end == request.first:
      alloc.cache(request.id, request.digests)  # its whole pages are written: later prompts may share them
      self._emit(request, int(tokens[-1]), finished)
    if budget > take and any(r.computed < r.first for r in self.running):
      self._prefill(finished, budget - take)

  def _mixed_width(self, positions: int) -> int:
    """Page-table columns of a mixed call covering `positions`: a power of two (at most max_pages),
    so that with the chunk's width the call compiles for few shapes."""
    return min(self.max_pages, 1 << (self.allocator.pages_for(positions) - 1).bit_length())

  def _chunk_bucket(self, tokens: int) -> int:
    """Columns of a mixed call's chunk of `tokens` (a power of two, or fewer than
    MIN_PROMPT_BUCKET): at least MIN_PROMPT_BUCKET."""
    return max(steps.MIN_PROMPT_BUCKET, 1 << (tokens - 1).bit_length())

  def _count_step(self) -> list[Request]:
    """Counts a decode step in the stats -> the requests decoding in it."""
    alloc = self.allocator
    running = [r for r in self.running if r.decoding]
    stats, cached, allocated = (
      self.stats,
      sum(alloc.length(r.id) for r in running),
      sum(alloc.capacity(r.id) for r in running),
    )
    stats.decode_steps += 1
    stats.max_running = max(stats.max_running, len(running))
    stats.cached_total += cached
    stats.allocated_total += allocated
    if self.config.trace_steps:
      stats.running.append(len(running))
      stats.cached.append(cached)
      stats.allocated.append(allocated)
    return running

  def _decode(self, finished: list[Request]) -> None:
    running = self._count_step()
    rows = [r if r is not None and r.decoding else None for r in self.slots]
    tokens = self._run_decode(rows, self._width(max(self.allocator.length(r.id) for r in running)))
    for request in running:
      self._emit(request, int(tokens[request.slot]), finished)

  # Device calls.

  def _run_prefill(self, tokens, length: int, page_table) -> jax.Array:
    """One request's first `length` tokens (tokens int[1, bucket]) into its empty pages -> logits [1, V]."""
    cache = self.cache.with_rows(page_table, np.zeros(1, np.int32), np.zeros(1, np.int32))
    logits, self.cache = steps.prefill(
      self.model, self.params, cache, jnp.asarray(tokens), jnp.array([length], jnp.int32)
    )
    return logits

  def _recompute(self, context: np.ndarray, first: int, table) -> jax.Array:
    """A preempted request's generated tokens context[first:] after its pressed prompt -> the last
    one's logits [1, V]: one call, or under a decode budget one call per token (the row is pressed
    as it was when it decoded them)."""
    if not self.press.decode_budget:
      rest = context[first:]
      return self._run_extend(steps.padded(rest, self.max_len), rest.size, table, first, self._held(first, 0))
    for i in range(first, context.size):
      logits = self._run_extend(
        steps.padded(context[i : i + 1], self.max_len), 1, table, i, self._held(first, i - first)
      )
    return logits

  def _run_extend(self, tokens, length: int, page_table, position: int, filled: int) -> jax.Array:
    """`length` more tokens after a request's `position` positions held in `filled` slots -> logits [1, V]."""
    cache = self.cache.with_rows(page_table, np.array([position], np.int32), np.array([filled], np.int32))
    logits, self.cache = steps.extend(
      self.model, self.params, cache, jnp.asarray(tokens), jnp.array([length], jnp.int32)
    )
    return logits

  def _decode_inputs(self, slots: list[Request | None]) -> dict:
    """A decode step's rows (None: idle) -> their ids, the positions each holds before its token
    (lengths), the slots it fills (filled), and the tokens they take."""
    return dict(
      ids=[None if r is None else r.id for r in slots],
      lengths=np.array([0 if r is None else r.prompt.size + len(r.generated) - 1 for r in slots], np.int32),
      filled=np.array([0 if r is None else self._held(r.prompt.size, len(r.generated) - 1) for r in slots], np.int32),
      tokens=np.array([0 if r is None else r.generated[-1] for r in slots], np.int32),
    )

  def _pick(self, logits, rows: list[Request | None]) -> np.ndarray:
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

  def _run_mixed(self, slots: list[Request | None], request: Request | None, chunk, width: int) -> np.ndarray:
    """One mixed call: every row's decode token (None: idle) and `chunk` int[C'] of `request`'s
    context after what its pages hold (None: an idle chunk row) -> each row's next token, then the
    chunk's."""
    rows = self._decode_inputs(slots)
    padded = np.zeros((1, self._chunk_bucket(chunk.size)), np.int32)
    padded[0, : chunk.size] = chunk
    ids = rows["ids"] + [None if request is None else request.id]
    table = self.allocator.page_table(ids, self.max_pages)[:, :width]
    start = 0 if request is None else request.computed
    cache = self.cache.with_rows(table, np.append(rows["lengths"], start))
    logits, self.cache = mixed.step(
      self.model, self.params, cache, jnp.asarray(rows["tokens"]), jnp.asarray(padded), jnp.array([chunk.size])
    )
    return self._pick(logits, slots + [request])

  def _run_decode(self, slots: list[Request | None], width: int) -> np.ndarray:
    """One decode step over all rows; a request's pages already hold the slot it writes."""
    rows = self._decode_inputs(slots)
    table = self.allocator.page_table(rows["ids"], self.max_pages)[:, :width]
    cache = self.cache.with_rows(table, rows["lengths"], rows["filled"])
    logits, self.cache = steps.decode(self.model, self.params, cache, jnp.asarray(rows["tokens"]))
    return self._pick(logits, slots)
