"""The KV frontier: every family of KV compression on one model, quality and recall against KV bytes.

The model is a toy one trained here on bytes (`gqa`: a GQA study's MHA-big and its uptrainings,
kvjax.studies.parts.toy_kv) or a pretrained one (`source`: kvjax.studies.parts.real_kv's import and
conversions). A variant (kvjax.studies.base.variants.Variant) names the params it runs and the cache
it decodes them through; the families are kvjax.studies.base.variants.FAMILIES. Every variant's cache
is checked against the model it runs before anything trains: one error names it.

Every variant is measured alike by kvjax.studies.base.measure (toy_kv.measure_row, real_kv.measure_row):
KV bytes per token, quality through the cache (bits per byte of a toy model, perplexity of a
pretrained one), recall (a toy model's needles; a pretrained model's RULER-style suite,
kvjax.studies.suite.axis, and the pass key when asked; per-sample records kept under each row's
"samples", a pretrained model's also as WORKDIR/samples.jsonl and answers.jsonl) and the decode
step. A pretrained frontier may add peers: other models measured as trained, through the full
cache (Gemma 3 270M is MQA as trained). `pareto` marks the front of quality (and of a pretrained
model's suite score) against KV bytes per token. The report (kvjax.studies.parts.kv_frontier_report): kv_frontier.{md,csv,json} and its
figures in the workdir.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Callable

from kvjax.cache.config import CacheConfig
from kvjax.studies.parts import gqa as gs
from kvjax.studies.parts import kv_frontier_report, real_kv, toy_kv
from kvjax.studies.suite.passkey_run import write_records
from kvjax.studies.parts.real_kv import Measure, Recovery
from kvjax.studies.base.stages import time_per_sample
from kvjax.studies.parts.toy_kv import ToyMeasure
from kvjax.studies.base.variants import Variant, check_distinct, pareto
from kvjax.training import checkpoint
from kvjax.training.data import load_dataset
from kvjax.training.evaluate import evaluate

RECALL = "suite_mean"  # a pretrained model's recall axis: the suite's mean score over its lengths, in %


@dataclasses.dataclass(frozen=True)
class KVFrontierStudy:
  """The study `kvjax run` runs for job "kv_frontier".

  gqa: a toy frontier, on this GQA study's MHA-big (its big, data, train and fraction); or
  source: a pretrained model (a name `kvjax import` knows, a .gguf, a Hugging Face folder), its
    first source_layers layers when given, conversions recovered by `recovery`.
  models_from: another study's workdir whose finished models to read (a GQA study's for a toy
    frontier, a real-model study's with the same source and recovery otherwise); '' makes them here.
  measure: a ToyMeasure (toy) or a real_kv.Measure (pretrained); None takes the defaults.
  peers: pretrained models measured as trained beside the variants (a pretrained frontier only):
    a name `kvjax import` knows, a file, a folder or a kvjax workdir holding an imported checkpoint;
    e.g. ("gemma3-270m",), the MQA row as trained.
  """

  job: str = "kv_frontier"
  gqa: gs.GqaStudy | None = None
  source: str = ""
  source_layers: int | None = None
  recovery: Recovery = dataclasses.field(default_factory=Recovery)
  models_from: str = ""
  variants: tuple[Variant, ...] = ()
  measure: ToyMeasure | Measure | None = None
  peers: tuple[str, ...] = ()

  def __post_init__(self):
    if self.job != "kv_frontier":
      raise ValueError(f"KVFrontierStudy.job must be 'kv_frontier', got {self.job!r}")
    if (self.gqa is None) == (not self.source):
      raise ValueError(
        f"KVFrontierStudy needs one model: gqa (a toy MHA-big) or source (a pretrained model), got "
        f"gqa={'set' if self.gqa is not None else None}, source={self.source!r}"
      )
    if self.gqa is not None and not isinstance(self.gqa, gs.GqaStudy):
      raise ValueError(f"KVFrontierStudy.gqa must be a GqaStudy, got {self.gqa!r}")
    if not isinstance(self.recovery, Recovery):
      raise ValueError(f"KVFrontierStudy.recovery must be a Recovery, got {self.recovery!r}")
    if not isinstance(self.models_from, str):
      raise ValueError(f"KVFrontierStudy.models_from must be a path or '', got {self.models_from!r}")
    check_distinct(self.variants, "KVFrontierStudy.variants")
    real_kv.check_peers(self.peers, "KVFrontierStudy.peers")
    if self.peers and self.gqa is not None:
      raise ValueError(f"KVFrontierStudy.peers are pretrained models: a toy frontier has none, got {self.peers!r}")
    if set(map(real_kv.peer_name, self.peers)) & {v.name for v in self.variants}:
      raise ValueError(f"KVFrontierStudy.peers {self.peers!r} share a name with a variant")
    kind = ToyMeasure if self.toy else Measure
    measure = kind() if self.measure is None else self.measure
    if not isinstance(measure, kind):
      raise ValueError(
        f"KVFrontierStudy.measure must be a {kind.__name__} for a {'toy' if self.toy else 'pretrained'} model, "
        f"got {self.measure!r}"
      )
    object.__setattr__(self, "measure", measure.resolved(self.gqa) if self.toy else measure)
    if self.toy:
      for variant in self.variants:
        check_cache(toy_kv.model_config(variant, self.gqa), variant)

  @property
  def toy(self) -> bool:
    return self.gqa is not None

  def folder(self, variant: Variant) -> str:
    """The folder of the params `variant` runs."""
    return toy_kv.folder(variant, self.gqa) if self.toy else real_kv.folder(variant, self.recovery)


def check_cache(config, variant: Variant) -> None:
  """Raises ValueError naming the variant unless its cache fits a model of `config` (its codec
  the vectors' widths, its window the model's length)."""
  try:
    variant.cache.codec(config)
    variant.cache.model(config)
  except ValueError as err:
    raise ValueError(f"variant {variant.name!r} ({variant.describe()}) cannot decode its model: {err}") from None


def run(study: KVFrontierStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """Every variant's row, in study.variants' order; writes the report into workdir."""
  workdir = Path(workdir)
  rows = toy_rows(study, workdir, progress) if study.toy else pretrained_rows(study, workdir, progress)
  kv_frontier_report.write(study, rows, workdir)
  return rows


def toy_rows(study: KVFrontierStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """The toy rows (kvjax.studies.parts.toy_kv.measure_row), each with plain_bits_per_byte (the params'
  own model without a cache, `kvjax eval`'s number) and decode_step_ms (the median of
  measure.timing.repeats jitted generate calls over measure.timing.new_tokens, every variant
  timed round-robin in one run); pareto: the front of bits_per_byte."""
  settings = study.measure
  paths = toy_kv.prepare(study.gqa, study.variants, workdir, study.models_from, progress)
  data = load_dataset(study.gqa.data)
  loaded = {name: checkpoint.load_model(path)[:2] for name, path in paths.items()}
  progress("kv_frontier: evaluating the params without a cache")
  plain = {
    name: evaluate(model, params, data, batch_size=settings.eval_batch_size, num_batches=settings.eval_batches)[
      "bits_per_byte"
    ]
    for name, (model, params) in loaded.items()
  }
  rows = []
  for variant in study.variants:
    model, params = loaded[study.folder(variant)]
    progress(f"kv_frontier: measuring {variant.name}")
    rows.append(
      {
        "variant": variant.name,
        "family": variant.family,
        "params": study.folder(variant),
        "changes": variant.describe(),
        "kv_heads": model.config.num_kv_heads,
        "cache_dtype": variant.cache.codec(model.config).name,
        "kv_latent_rank": model.config.kv_latent_rank,
        "rope_dims": model.config.rope_dims,
        **toy_kv.measure_row(model, params, data, settings, variant.cache),
        "plain_bits_per_byte": plain[study.folder(variant)],
      }
    )
  progress("kv_frontier: timing the decode step of every variant")
  timing = time_per_sample(
    {v.name: loaded[study.folder(v)] for v in study.variants},
    settings.timing,
    {v.name: v.cache for v in study.variants},
  )
  for row, on_front in zip(rows, pareto(rows, "kv_bytes_per_token", "bits_per_byte")):
    times = timing[row["variant"]]["times_s"]
    row["decode_step_ms"] = 1e3 * statistics.median(times) / settings.timing.new_tokens
    row["times_s"] = times
    row["pareto"] = on_front
  return rows


def pretrained_rows(study: KVFrontierStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """The pretrained rows (kvjax.studies.parts.real_kv.measure_row), one model in memory at a time: the
  variants', then one per peer (its own import through the full cache, family "<MQA|GQA-K|MHA>
  as trained", its recall samples made by its own tokenizer); pareto_perplexity and pareto_recall:
  the fronts of perplexity at the longest context and of the suite's mean score."""
  m = study.measure
  paths = real_kv.prepare(
    study.source,
    study.source_layers,
    study.recovery,
    list(study.variants),
    workdir,
    study.models_from,
    progress,
    peers=study.peers,
  )
  for variant in study.variants:  # every cache fits its model before anything is measured
    check_cache(real_kv.stored_config(paths[study.folder(variant)]), variant)
  rows, loaded, windows, inputs = [], {}, None, []
  for variant in study.variants:
    folder = study.folder(variant)
    if folder not in loaded:
      loaded.clear()
      loaded[folder] = real_kv.load(paths[folder])
    model, params, tokenizer = loaded[folder]
    if windows is None:
      windows = {c: real_kv.prose_windows(tokenizer, c, m.windows) for c in m.contexts}
      inputs = real_kv.recall_inputs(tokenizer, m, model.config.max_len)
    progress(f"kv_frontier: measuring {variant.name}")
    rows.append(
      {
        "variant": variant.name,
        "family": variant.family,
        "params": folder,
        "cache": variant.describe(),
        **real_kv.measure_row(model, params, tokenizer, variant.cache, m, windows, inputs, variant.name),
      }
    )
  loaded.clear()
  for peer in study.peers:
    name, folder = real_kv.peer_name(peer), real_kv.peer_folder(peer)
    model, params, tokenizer = real_kv.load(paths[folder])
    own = real_kv.recall_inputs(tokenizer, m, model.config.max_len, model=name)
    progress(f"kv_frontier: measuring {name}, as trained")
    own_windows = {c: real_kv.prose_windows(tokenizer, c, m.windows) for c in m.contexts}
    rows.append(
      {
        "variant": name,
        "family": f"{real_kv.attention_kind(model.config)} as trained",
        "params": folder,
        "cache": "full cache",
        **real_kv.measure_row(model, params, tokenizer, CacheConfig(), m, own_windows, own, name),
      }
    )
    inputs += own
  longest = f"perplexity_{max(m.contexts)}"
  for row, quality, recall in zip(
    rows,
    pareto(rows, "kv_bytes_per_token", longest),
    pareto(rows, "kv_bytes_per_token", RECALL, lower=False),
  ):
    row["pareto_perplexity"], row["pareto_recall"] = quality, recall
  write_records(workdir, inputs, [r for row in rows for r in row["samples"]])
  return rows
