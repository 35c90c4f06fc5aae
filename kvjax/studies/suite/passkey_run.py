"""Running the pass-key test (kvjax.studies.suite.passkey) through a KV cache, and writing its
per-sample records: the inputs as WORKDIR/samples.jsonl, the answers as WORKDIR/answers.jsonl
(kvjax.studies.base.scoring), one line per (sample, method), so that two caches or two libraries
can be compared sample by sample."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvjax.cache.config import CacheConfig, cache_name
from kvjax.fields import to_dict
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.transformer import Transformer
from kvjax.model.weights import check_format, store
from kvjax.studies.base import measure, scoring
from kvjax.studies.base.models import tokenized_checkpoint
from kvjax.studies.suite.passkey import PasskeyConfig, Prose, answer_budget, judge, samples
from kvjax.training.checkpoint import latest_step


def all_samples(tokenizer: TextTokenizer, config: PasskeyConfig) -> list[dict]:
  """Every sample of the config, length by length (kvjax.studies.suite.passkey.samples)."""
  prose = Prose.of(tokenizer)
  return [s for length in config.lengths for s in samples(tokenizer, config, length, prose)]


def passkey(
  model: Transformer,
  params,
  tokenizer: TextTokenizer,
  config: PasskeyConfig,
  *,
  cache_config: CacheConfig = CacheConfig(),
  inputs: list[dict] | None = None,
  method: str = "full",
) -> dict[str, dict]:
  """Recall per prompt length through a cache of cache_config (kvjax.studies.base.measure.recall,
  config.batch_size examples at a time) -> {str(L): {"length", "recall" (the fraction of samples
  whose answer holds the key), "needles", "samples"}}; samples: one result per example
  (passkey.judge's, with "index" and `method`). inputs: all_samples(tokenizer, config), made
  here unless given (a study answering them through many caches draws them once)."""
  first = str(10 ** (config.digits - 1))
  longest = max(config.lengths) + answer_budget(tokenizer, config, first)
  cache_config.model(model.config).check_length(
    longest, f"PasskeyConfig.lengths: length {max(config.lengths)} and its answer need {longest} positions"
  )
  inputs = all_samples(tokenizer, config) if inputs is None else inputs
  out = {}
  for length in config.lengths:
    group = [s for s in inputs if s["length"] == length]
    prompts = np.array([s["context_ids"] + s["question_ids"] for s in group], np.int32)  # [n, length]
    rate, results = measure.recall(
      model,
      params,
      prompts,
      np.full(len(group), length, np.int32),
      group,
      judge(tokenizer),
      max(s["answer_tokens"] for s in group),
      cache_config,
      batch_size=config.batch_size,
      stop_ids=tokenizer.stop_ids,
    )
    results = [{**r, "method": method} for r in results]
    out[str(length)] = {"length": length, "recall": rate, "needles": len(group), "samples": results}
  return out


def write_records(workdir: str | Path, inputs: list[dict], answers: list[dict]) -> tuple[Path, Path]:
  """WORKDIR/samples.jsonl (the inputs) and WORKDIR/answers.jsonl (every result) -> their paths."""
  workdir = Path(workdir)
  return scoring.write_jsonl(workdir / scoring.SAMPLES, inputs), scoring.write_jsonl(workdir / scoring.ANSWERS, answers)


def passkey_checkpoint(
  workdir: str | Path,
  config: PasskeyConfig,
  *,
  step: int | None = None,
  cache_config: CacheConfig | None = None,
  weights: str = "float32",
) -> dict:
  """`passkey` of a workdir's checkpoint (latest unless `step`) with its tokenizer, through a cache
  of `cache_config` (default: contiguous, the model's dtype), the weights stored as `weights`;
  the samples and answers are written to the workdir (write_records) and left out of the result."""
  check_format(weights)
  step = latest_step(workdir) if step is None else step
  model, params, tokenizer = tokenized_checkpoint(
    workdir,
    step,
    needs="the pass-key test is for tokenized models (the byte-level recall test serves models trained here)",
  )
  params = store(params, weights)
  cache_config = (cache_config or CacheConfig()).bind(tokenizer)
  inputs = all_samples(tokenizer, config)
  found = passkey(
    model, params, tokenizer, config, cache_config=cache_config, inputs=inputs, method=cache_name(cache_config)
  )
  samples_path, answers_path = write_records(workdir, inputs, [r for f in found.values() for r in f["samples"]])
  return {
    "step": step,
    "test": "passkey",
    "digits": config.digits,
    "seed": config.seed,
    "wording": config.wording,
    "cache": to_dict(cache_config),
    "weights": weights,
    "samples": str(samples_path),
    "answers": str(answers_path),
    "recall": {length: {k: v for k, v in f.items() if k != "samples"} for length, f in found.items()},
  }
