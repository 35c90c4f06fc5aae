"""The RULER-style long-context suite (Hsieh et al. 2024) as a job: every task at each context
length, through the full cache and each press at each ratio, answered and scored by
kvjax.studies.suite.ruler_answers (the samples, the protocols, the scoring).

Files: samples.jsonl (one sample per line, the inputs) and answers.jsonl (one result per line:
id, task, length, method, answer, score, depth, distance), as `kvjax eval --ruler` and the study
write them.

Run: kvjax run configs/ruler/small.py --workdir runs/ruler
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable


from kvjax.cache.config import CacheConfig, cache_name
from kvjax.fields import check_nonnegative, check_positive
from kvjax.studies.base import report
from kvjax.studies.base.measure import PROTOCOLS
from kvjax.studies.base.models import tokenized_checkpoint
from kvjax.studies.suite.ruler_prompts import TEMPLATES
from kvjax.studies.suite.ruler_tasks import TASKS, check_tasks
from kvjax.studies.base.scoring import write_jsonl
from kvjax.studies.base.variants import cache

from kvjax.studies.suite.ruler_answers import NEEDS, answer, build, check_lengths, load, summary


@dataclasses.dataclass(frozen=True)
class RulerStudy:
  """source: the model (a name kvjax import knows, a GGUF file, a Hugging Face directory or a
  kvjax workdir holding an imported checkpoint). `samples` per task and length; each press of
  `presses` at each of `ratios`, after the full cache; `template` "auto" (the chat template when
  the tokenizer has one), "chat" or "base"."""

  source: str = "smollm2-135m"
  lengths: tuple[int, ...] = (1024, 2048)
  tasks: tuple[str, ...] = tuple(TASKS)
  samples: int = 8
  presses: tuple[str, ...] = ()
  ratios: tuple[float, ...] = (0.5,)
  protocol: str = "query_agnostic"
  template: str = "auto"
  batch_size: int = 8
  seed: int = 0
  job: str = "ruler"

  def __post_init__(self):
    if self.job != "ruler":
      raise ValueError(f"RulerStudy.job must be 'ruler', got {self.job!r}")
    check_positive(self, "samples", "batch_size")
    check_nonnegative(self, "seed")
    check_tasks(self.tasks)
    check_lengths(self.lengths)
    if self.protocol not in PROTOCOLS:
      raise ValueError(f"RulerStudy.protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
    if self.template not in TEMPLATES:
      raise ValueError(f"RulerStudy.template must be one of {TEMPLATES}, got {self.template!r}")
    for press in self.presses:
      for ratio in self.ratios:
        cache(press=press, ratio=ratio)  # an unknown press or a ratio outside [0, 1) is refused, named


def run(study: RulerStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Every cache of the study on the suite -> rows {method, length, task, score, samples, seconds};
  writes samples.jsonl, answers.jsonl and ruler.{csv,json,md} to workdir."""
  workdir = Path(workdir)
  model, params, tokenizer, name = load(study.source)
  samples = build(
    tokenizer,
    study.tasks,
    study.lengths,
    study.samples,
    seed=study.seed,
    template=study.template,
    max_len=model.config.max_len,
  )
  write_jsonl(workdir / "samples.jsonl", samples)
  rows, results = [], []
  for press, ratio in [(None, 0.0)] + [(p, r) for p in study.presses for r in study.ratios]:
    cache_config = cache(press=press, ratio=ratio)
    start = time.perf_counter()
    found = answer(
      model,
      params,
      tokenizer,
      samples,
      cache_config,
      protocol=study.protocol,
      batch_size=study.batch_size,
      progress=progress,
    )
    seconds = time.perf_counter() - start
    results += found
    scores = summary(found)
    for length, per in scores["tasks"].items():
      for task, value in per.items():
        rows.append({"method": cache_name(cache_config), "length": int(length), "task": task, "score": value})
      rows.append(
        {"method": cache_name(cache_config), "length": int(length), "task": "mean", "score": scores["lengths"][length]}
      )
    rows[-1]["seconds"] = round(seconds, 1)
  write_jsonl(workdir / "answers.jsonl", results)
  columns = [("method", "cache", ""), ("length", "tokens", ""), ("task", "task", ""), ("score", "score %", ".1f")]
  table = report.write_table(rows, workdir / "ruler", columns)
  (workdir / "ruler.md").write_text(
    f"RULER-style suite: {name}, {study.samples} samples per task and length, {study.protocol}, "
    f"template {study.template}, seed {study.seed}\n\n{table}\n"
  )
  return rows


def ruler_checkpoint(
  workdir: str | Path,
  lengths: tuple[int, ...],
  *,
  tasks: tuple[str, ...] = tuple(TASKS),
  samples: int = 8,
  seed: int = 0,
  cache_config: CacheConfig | None = None,
  protocol: str = "query_agnostic",
  out: str | Path | None = None,
  progress: Callable[[str], None] = lambda message: None,
) -> dict:
  """The suite on a workdir's latest checkpoint (an imported model) through caches of
  cache_config; writes samples.jsonl and answers.jsonl to `out` (default WORKDIR/ruler) ->
  {"method", "protocol", "samples", "seconds", "out", **summary}."""
  cache_config = cache_config or CacheConfig()
  model, params, tokenizer = tokenized_checkpoint(workdir, needs=NEEDS)
  items = build(tokenizer, tasks, lengths, samples, seed=seed, max_len=model.config.max_len)
  out = Path(out) if out is not None else Path(workdir) / "ruler"
  write_jsonl(out / "samples.jsonl", items)
  start = time.perf_counter()
  results = answer(model, params, tokenizer, items, cache_config, protocol=protocol, progress=progress)
  seconds = time.perf_counter() - start
  write_jsonl(out / "answers.jsonl", results)
  return {
    "method": cache_name(cache_config),
    "protocol": protocol,
    "samples": samples,
    "seconds": round(seconds, 1),
    "out": str(out),
    **summary(results),
  }
