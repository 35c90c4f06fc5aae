"""The eviction study: needle recall and perplexity of a pretrained model through every press.

Each press (kvjax.cache.layouts.evict) is measured at each compression ratio, beside the full cache, by
kvjax.studies.base.measure.

Needle recall follows kvpress's protocol: kvjax.studies.suite.passkey's prompts of exactly `context`
tokens (the instruction, a 5-digit key sentence at a random depth, whole sentences of held-out
prose: the context_ids; then the question in the chat template: the question_ids); greedy
answers of the pass-key answer budget, scored as RULER scores (the key appears in the answer).
Two protocols:
  query_agnostic  the context is pressed before the question arrives (kvpress's pipeline; a
                  cache shared by many questions must be): prefill the context through the
                  press, then extend the question into the evicted cache and decode;
  query_aware     the question is inside the pressed prompt (SnapKV's setting): generate from
                  the whole prompt through the press.
Perplexity: held-out prose windows of perplexity_context + continuation tokens; the context is
pressed, then the continuation is read through the evicted cache and scored (the tokens the
prefill's own logits predict are left out: no press changes them). Every row keeps its needles'
per-sample records under "samples" (passkey.judge's, with "index", "method" (e.g. "snapkv@0.75" or
"full") and "protocol"), also written as WORKDIR/samples.jsonl and answers.jsonl.

Run: kvjax run configs/eviction/smollm2.py --workdir runs/eviction
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np

from kvjax.cache.config import CacheConfig, cache_name
from kvjax.cache.presses import PRESSES
from kvjax.fields import check_positive, check_nonnegative
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.studies.base import measure, report
from kvjax.studies.base.measure import PROTOCOLS
from kvjax.studies.suite.passkey import PasskeyConfig, judge
from kvjax.studies.suite.passkey_run import all_samples, write_records
from kvjax.studies.base.variants import cache
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset


@dataclasses.dataclass(frozen=True)
class EvictionStudy:
  """source: the pretrained model (a name kvjax import knows, or a file). presses x ratios for
  perplexity, presses x recall_ratios x PROTOCOLS for recall; `trials` needles per cell, in
  prompts of `context` tokens; answer_tokens as PasskeyConfig's (None: the pass-key rule)."""

  source: str = "smollm2-135m"
  presses: tuple[str, ...] = tuple(PRESSES)
  ratios: tuple[float, ...] = (0.5, 0.75, 0.875)
  recall_ratios: tuple[float, ...] = (0.75,)
  trials: int = 24
  context: int = 950
  answer_tokens: int | None = None
  batch_size: int = 8
  perplexity_context: int = 1024
  continuation: int = 256
  windows: int = 4
  seed: int = 0
  job: str = "eviction"

  def __post_init__(self):
    if self.job != "eviction":
      raise ValueError(f"EvictionStudy.job must be 'eviction', got {self.job!r}")
    check_positive(self, "trials", "context", "batch_size", "perplexity_context", "continuation")
    check_nonnegative(self, "windows", "seed")
    if self.context < 128:
      raise ValueError(
        f"EvictionStudy.context must be at least 128 tokens (a needle at a random depth), got {self.context}"
      )
    for press in self.presses:
      if press not in PRESSES:
        raise ValueError(f"EvictionStudy.presses: {press!r} is not one of {tuple(PRESSES)}")
    if self.answer_tokens is not None:
      check_positive(self, "answer_tokens")
    for name in ("ratios", "recall_ratios"):
      for ratio in getattr(self, name):
        cache(press="knorm", ratio=ratio)  # a ratio outside [0, 1) is refused, named

  def passkey(self) -> PasskeyConfig:
    """The pass-key settings of the needles."""
    return PasskeyConfig(
      lengths=(self.context,),
      needles=self.trials,
      answer_tokens=self.answer_tokens,
      batch_size=self.batch_size,
      seed=self.seed,
    )


def needles(tokenizer, study: EvictionStudy):
  """study.trials pass-key samples of `context` tokens -> (contexts int32 [n, c], question int32
  [q], samples): the needle sentence at a random depth of the contexts, the question after them
  (the same for every sample)."""
  samples = all_samples(tokenizer, study.passkey())
  contexts = np.array([s["context_ids"] for s in samples], np.int32)
  return contexts, np.array(samples[0]["question_ids"], np.int32), samples


def recall(model, params, tokenizer, cache_config: CacheConfig, protocol: str, trials, study: EvictionStudy, name: str):
  """Recall (%) of the needles `trials` (needles()) through caches of cache_config, and one
  result per needle marked with `name` and the protocol -> (recall, samples)."""
  contexts, question, samples = trials
  prompts, lengths, asked = measure.protocol_inputs(protocol, contexts, [question] * len(contexts))
  rate, results = measure.recall(
    model,
    params,
    prompts,
    lengths,
    samples,
    judge(tokenizer),
    max(s["answer_tokens"] for s in samples),
    cache_config,
    batch_size=study.batch_size,
    stop_ids=tokenizer.stop_ids,
    **asked,
  )
  return 100.0 * rate, [{**r, "method": name, "protocol": protocol} for r in results]


def run(study: EvictionStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Every cell of the study -> rows {press, ratio, perplexity, recall_query_agnostic,
  recall_query_aware, samples}; writes eviction.{csv,json,md}, samples.jsonl and answers.jsonl
  to workdir."""
  workdir = Path(workdir)
  params, config, tokenizer, path = read_model(study.source)
  if tokenizer is None:
    raise ValueError(f"EvictionStudy.source={study.source!r} has no tokenizer; the needles need one")
  model = Transformer(config)
  trials = needles(tokenizer, study)
  length = study.perplexity_context + study.continuation
  data = load_dataset(DataConfig(source=PROSE, seq_len=length), tokenizer)
  windows = list(eval_batches(data.val, length, study.windows, 1))
  rows = []
  for press, ratio in [(None, 0.0)] + [
    (p, r) for p in study.presses for r in sorted({*study.ratios, *study.recall_ratios})
  ]:
    unbound = cache(press=press, ratio=ratio)
    name = cache_name(unbound)  # named before the tokenizer binds KVzip's prompt
    cache_config = unbound.bind(tokenizer)
    progress(f"eviction: measuring {press or 'the full cache'}" + (f" at ratio {ratio:g}" if press else ""))
    row = {"press": press or "full cache", "ratio": ratio}
    if press is None or ratio in study.ratios:
      row["perplexity"] = (
        measure.perplexity(model, params, windows, cache_config, study.perplexity_context) if study.windows else None
      )
    samples = []
    if press is None or ratio in study.recall_ratios:
      for protocol in PROTOCOLS:
        row[f"recall_{protocol}"], found = recall(model, params, tokenizer, cache_config, protocol, trials, study, name)
        samples += found
    rows.append({**row, "samples": samples})
  columns = [
    ("press", "press", ""),
    ("ratio", "compression ratio", ".3f"),
    ("perplexity", "perplexity", ".3f"),
    ("recall_query_agnostic", "recall %, query-agnostic", ".1f"),
    ("recall_query_aware", "recall %, query-aware", ".1f"),
  ]
  table = report.write_table(rows, workdir / "eviction", columns)
  write_records(workdir, trials[2], [r for row in rows for r in row["samples"]])
  (workdir / "eviction.md").write_text(
    f"Eviction study: {path.name}, {study.trials} needles of {study.context} tokens, "
    f"{study.windows} windows of {study.perplexity_context} + {study.continuation} tokens\n\n{table}\n"
  )
  return rows
