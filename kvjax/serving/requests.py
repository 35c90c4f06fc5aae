"""The engine's bookkeeping (kvjax.serving.engine): one request as it waits, prefills and decodes,
and the counters of a run."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Request:
  id: int
  prompt: np.ndarray  # int32[L]
  max_new_tokens: int
  sampling: tuple[float, int, float]  # temperature, top_k, top_p (0 and 1 disable the filters)
  generated: list[int] = dataclasses.field(default_factory=list)
  slot: int | None = None
  preemptions: int = 0
  # While admitted: the context positions its pages hold computed so far, how many its prefill
  # computes (the pressed prompt, or the whole context), and the digests of their whole pages.
  computed: int = 0
  first: int = 0
  digests: list[bytes] = dataclasses.field(default_factory=list)

  @property
  def decoding(self) -> bool:
    return self.slot is not None and self.computed >= self.first and bool(self.generated)

  @property
  def context(self) -> np.ndarray:
    return np.concatenate([self.prompt, np.asarray(self.generated, np.int32)])


@dataclasses.dataclass
class EngineStats:
  """Counters, and with EngineConfig.trace_steps one entry per decode step (requests decoding,
  tokens cached, token slots allocated; a server leaves it off, so its memory stays flat)."""

  prefills: int = 0
  prompt_tokens: int = 0  # context tokens admitted (a preempted request's again when it returns)
  cached_tokens: int = 0  # of those, read from the prefix cache instead of computed
  preemptions: int = 0
  generated_tokens: int = 0
  decode_steps: int = 0
  mixed_steps: int = 0  # of those, steps that also computed a chunk of a context (kvjax.serving.mixed)
  max_running: int = 0
  cached_total: int = 0  # tokens cached, summed over the decode steps
  allocated_total: int = 0  # token slots allocated, summed over the decode steps
  running: list[int] = dataclasses.field(default_factory=list)
  cached: list[int] = dataclasses.field(default_factory=list)
  allocated: list[int] = dataclasses.field(default_factory=list)

  @property
  def utilisation(self) -> float:
    """KV slots holding real tokens / slots allocated, summed over the decode steps."""
    return self.cached_total / max(1, self.allocated_total)
