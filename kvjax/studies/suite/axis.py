"""The RULER-style suite as a study's recall axis (kvjax.studies.kv_frontier, real_gqa): a few
tasks of kvjax.studies.suite.ruler_tasks at a few context lengths, answered through each variant's
cache and scored as RULER scores them (kvjax.studies.ruler).

A row gains suite_L (the mean over the tasks of the mean score of their samples at L tokens, in %)
for every length and suite_mean (the mean over lengths); its per-sample results (the shared
format, "method" the variant's name) join the row's "samples", and the study writes them to
WORKDIR/answers.jsonl beside the inputs in WORKDIR/samples.jsonl.
"""

from __future__ import annotations

import dataclasses

from kvjax.cache.config import CacheConfig
from kvjax.fields import check_choice, check_nonnegative, check_positive
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.transformer import Transformer
from kvjax.studies.suite import ruler_answers
from kvjax.studies.base.measure import PROTOCOLS
from kvjax.studies.suite.ruler_prompts import TEMPLATES
from kvjax.studies.suite.ruler_tasks import check_tasks

PREFIX = "suite_"


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
  """`samples` samples of each of `tasks` at each of `lengths` tokens (prompt included, exact for
  the model's tokenizer), seeded by `seed`, in `template` ("auto": the chat template when the
  tokenizer has one, else the base one), answered `batch_size` at a time under `protocol`
  (query_aware: the whole prompt in one generate, every cache kind; query_agnostic: kvpress's,
  the context pressed before the question is read)."""

  tasks: tuple[str, ...] = ("niah_single_1", "niah_multikey_1")
  lengths: tuple[int, ...] = (1024, 2048)
  samples: int = 4
  protocol: str = "query_aware"
  template: str = "auto"
  batch_size: int = 4
  seed: int = 0

  def __post_init__(self):
    check_positive(self, "samples", "batch_size")
    check_nonnegative(self, "seed")
    check_choice(self, "protocol", PROTOCOLS)
    check_choice(self, "template", TEMPLATES)
    try:
      check_tasks(self.tasks)
      ruler_answers.check_lengths(self.lengths)
    except ValueError as err:
      raise ValueError(f"SuiteConfig: {err}") from None
    if not isinstance(self.tasks, tuple) or not isinstance(self.lengths, tuple):
      raise ValueError(f"SuiteConfig.tasks and lengths must be tuples, got {self.tasks!r}, {self.lengths!r}")


def samples(tokenizer: TextTokenizer, config: SuiteConfig, max_len: int | None = None, model: str = "") -> list[dict]:
  """Every sample of the config (ruler_answers.build), marked with `model` (the name of the model whose
  tokenizer made them) when given, so that two models' samples of one id stay apart."""
  built = ruler_answers.build(
    tokenizer,
    config.tasks,
    config.lengths,
    config.samples,
    seed=config.seed,
    template=config.template,
    max_len=max_len,
  )
  return [{**s, "model": model} for s in built] if model else built


def scores(
  model: Transformer,
  params,
  tokenizer: TextTokenizer,
  cache_config: CacheConfig,
  config: SuiteConfig,
  inputs: list[dict],
  method: str,
) -> tuple[dict, list[dict]]:
  """The suite through caches of cache_config -> ({suite_L: % for each length, suite_mean: %},
  one result per sample marked `method`, and `model` as its sample is)."""
  found = ruler_answers.answer(
    model, params, tokenizer, inputs, cache_config, protocol=config.protocol, batch_size=config.batch_size
  )
  results = [{**r, "method": method, **({"model": s["model"]} if "model" in s else {})} for r, s in zip(found, inputs)]
  summary = ruler_answers.summary(results)
  row = {f"{PREFIX}{n}": summary["lengths"][str(n)] for n in config.lengths}
  row[f"{PREFIX}mean"] = round(sum(row.values()) / len(row), 2)
  return row, results
