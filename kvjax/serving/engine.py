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
The engine is the scheduler; its calls on the device are a `Runner`'s (kvjax.serving.runner).

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

import numpy as np

from kvjax.cache.layouts.paged_evict import capacity
from kvjax.fields import check_positive_int
from kvjax.decoding.sampling import Sampling
from kvjax.model.transformer import Transformer
from kvjax.serving import steps
from kvjax.serving.allocator import OutOfPages, PageAllocator, page_digests
from kvjax.serving.config import EngineConfig
from kvjax.serving.requests import EngineStats, Request
from kvjax.serving.runner import GREEDY, Runner


class Engine:
  """Continuous-batching generation: `submit` requests, then `step` or `run`."""

  def __init__(self, model: Transformer, params, config: EngineConfig = EngineConfig()):
    cfg, self.config = model.config, config
    self.max_len = config.max_len or cfg.max_len
    if self.max_len > cfg.max_len:
      raise ValueError(f"EngineConfig.max_len={self.max_len} exceeds ModelConfig.max_len={cfg.max_len}")
    self.allocator = PageAllocator(config.num_pages, config.cache.page_size)
    self.runner = Runner(model, params, config, self.allocator, self.max_len)
    # A pressed prompt's pages hold what the press kept of the whole prompt: no prefix of them is shareable.
    self.prefix_caching = config.prefix_caching and self.press is None
    self.waiting: list[Request] = []  # by id: preempted requests go back in arrival order
    self.slots: list[Request | None] = [None] * config.num_slots
    self.finished: dict[int, Request] = {}
    self.stats = EngineStats()
    self._next_id = 0

  # Public API.

  def submit(self, prompt, max_new_tokens: int, sampling: Sampling | None = None) -> int:
    """Queues a request; returns its id. prompt int[L]; sampling defaults to greedy."""
    prompt = np.asarray(prompt)
    vocab = self.runner.model.config.vocab_size
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
  def press(self):
    """The requests' press (EngineConfig.cache.press), or None."""
    return self.runner.press

  @property
  def max_pages(self) -> int:
    """Pages a request of max_len positions holds."""
    return self.runner.max_pages

  @property
  def cache(self):
    """The page pools (kvjax.cache.layouts.paged), as the last call left them."""
    return self.runner.cache

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
    """Compiles every call a workload can make (Runner.warmup), so that serving compiles nothing."""
    self.runner.warmup(extends=self.press is not None or self.prefix_caching)

  # Memory policy.

  def _held(self, prompt: int, generated: int) -> int:
    return self.runner.held(prompt, generated)

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
        logits = self.runner.prefill(context[:end], table)
      else:
        logits = self.runner.extend(context[start:end], table, start, start)
      request.computed, budget = end, budget - (end - start)
      if end < first:
        continue
      alloc.cache(request.id, request.digests)  # its whole pages are written: later prompts may share them
      if first < context.size:
        logits = self.runner.recompute(context, first, table)
        request.computed = context.size
      token = self.runner.pick(logits, [request])
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
    tokens = self.runner.mixed(rows, request, request.context[start:end], self.runner.mixed_width(positions))
    self.stats.mixed_steps += 1
    request.computed = end
    for r in running:
      self._emit(r, int(tokens[r.slot]), finished)
    if end == request.first:
      alloc.cache(request.id, request.digests)  # its whole pages are written: later prompts may share them
      self._emit(request, int(tokens[-1]), finished)
    if budget > take and any(r.computed < r.first for r in self.running):
      self._prefill(finished, budget - take)

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
    tokens = self.runner.decode(rows, self.runner.width(max(self.allocator.length(r.id) for r in running)))
    for request in running:
      self._emit(request, int(tokens[request.slot]), finished)
