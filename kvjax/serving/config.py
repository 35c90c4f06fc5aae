"""The engine's settings (kvjax.serving.engine): its rows, its page pool, how a request's memory
is allocated, its cache and weight formats."""

from __future__ import annotations

import dataclasses

from kvjax.cache.config import CacheConfig
from kvjax.fields import check_choice, check_positive
from kvjax.model.weights import FORMATS

ALLOCATIONS = ("paged", "doubling", "max_len")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """num_pages counts the null page, so num_pages - 1 pages of cache.page_size tokens hold KV.
  max_len (longest context, prompt + generated) defaults to ModelConfig.max_len. cache is the
  paged cache's codec, page size and read (kvjax.cache.config; its layout must be "paged", or
  "paged_evict" with a press, whose allocation must then be "paged")."""

  num_slots: int = 8
  num_pages: int = 257
  max_len: int | None = None
  allocation: str = "paged"
  cache: CacheConfig = CacheConfig(layout="paged")
  stop_ids: tuple[int, ...] = ()  # a request finishes after any of these tokens (the tokenizer's stop_ids)
  seed: int = 0
  weights: str = "float32"  # the format the engine stores the weights in (kvjax.model.weights)
  # Pages of a prompt prefix already in the pool (a system prompt, a shared document, earlier
  # turns of a chat) are shared, and only the rest of the prompt is computed (kvjax.serving.allocator).
  # A pressed cache keeps what the press chose from the whole prompt: its pages are never shared.
  prefix_caching: bool = True
  # Context tokens computed per step, over the rows still prefilling, oldest first: a long prompt
  # is prefilled in chunks between decode steps instead of stalling every running row at once.
  # 0: each context whole in the step it is admitted. A pressed prompt is always computed whole.
  prefill_chunk: int = 512
  # A step with decoding rows and a context still being computed runs both in one call: the rows'
  # tokens and the context's next chunk packed in one row (kvjax.serving.mixed). False: the chunk
  # is a call of its own before the decode step.
  mixed_steps: bool = True
  trace_steps: bool = False  # EngineStats keeps one entry per decode step (the KV-memory study's trace)

  def __post_init__(self):
    check_positive(self, "num_slots", "num_pages")
    if not isinstance(self.cache, CacheConfig) or self.cache.layout not in ("paged", "paged_evict"):
      raise ValueError(
        f"EngineConfig.cache must be a CacheConfig with layout='paged' (the engine allocates pages), or "
        f"'paged_evict' with a press, got {self.cache!r}"
      )
    if self.cache.press is not None and self.allocation != "paged":
      raise ValueError(
        f"EngineConfig.allocation={self.allocation!r} reserves positions ahead, which a pressed prompt "
        "does not keep; with CacheConfig.press the engine allocates 'paged'"
      )
    if self.max_len is not None:
      check_positive(self, "max_len")
    if self.num_pages < 2:
      raise ValueError(f"EngineConfig.num_pages={self.num_pages} leaves no page besides the null page")
    check_choice(self, "allocation", ALLOCATIONS)
    check_choice(self, "weights", FORMATS)
    if isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
      raise ValueError(
        f"EngineConfig.prefill_chunk must be an integer >= 0 (0: whole contexts), got {self.prefill_chunk!r}"
      )
    for name in ("prefix_caching", "mixed_steps", "trace_steps"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"EngineConfig.seed must be an integer, got {self.seed!r}")
    if not isinstance(self.stop_ids, (tuple, list)) or any(
      isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_ids
    ):
      raise ValueError(f"EngineConfig.stop_ids must be a tuple of token ids, got {self.stop_ids!r}")
    object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
