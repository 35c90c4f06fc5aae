"""Toy models for the KV frontier (kvjax.studies.kv_frontier): a GQA study's MHA-big, trained here
on bytes, and its uptrainings; and the toy measurement settings.

Models. MHA-big is pre-trained (the GQA study's big, data and train) and each conversion a variant
runs is an uptraining of it for alpha = gqa.fraction with the variant's distillation weight
(kvjax.studies.base.stages), every one a stage of WORKDIR/stages.json recorded under the GQA study's
settings as a GQA study's are; with `models_from`, a finished GQA study's workdir (a GQA table's
or another frontier's) is only read.

Measurements (measure_row), each through the cache a variant names, by kvjax.studies.base.measure:
  kv_bytes_per_token    measure.kv_bytes_per_token at ToyMeasure.context;
  bits_per_byte         held-out bits per byte on the windows `kvjax eval` scores, from the logits
                        of every position of one prefill of each window;
  decode_bits_per_byte  the same windows fed one byte per decode step after the first, so every
                        position reads what the cache stored, as generated tokens do (from an
                        empty cache a float kind reads the new K/V as computed, so a bfloat16
                        cache's rounding shows here only);
  recall                kvjax.studies.suite.recall at each distance (exact match and byte accuracy).
The decode step is timed by the study for every variant together (stages.time_per_sample).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable

from kvjax.config import ModelConfig
from kvjax.fields import check_positive
from kvjax.studies.parts import gqa as gs
from kvjax.studies.base import measure, stages
from kvjax.studies.suite import recall as byte_recall
from kvjax.studies.suite.recall import RecallConfig
from kvjax.studies.base.stages import TimingConfig
from kvjax.studies.base.variants import Variant
from kvjax.training.data import Dataset, eval_batches

MHA_BIG = "mha_big"


@dataclasses.dataclass(frozen=True)
class ToyMeasure:
  """context: the sequence length KV bytes per token are stated at (default the model's max_len).
  eval_batch_size, eval_batches: the held-out windows (default the GQA study's train.batch_size
  and train.eval_batches, as `kvjax eval`). recall: the byte needles. timing: the timed request
  whose decode steps are timed."""

  context: int | None = None
  recall: RecallConfig = dataclasses.field(default_factory=RecallConfig)
  timing: TimingConfig = dataclasses.field(default_factory=TimingConfig)
  eval_batch_size: int | None = None
  eval_batches: int | None = None

  def __post_init__(self):
    for name, cls in (("recall", RecallConfig), ("timing", TimingConfig)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"ToyMeasure.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
    for name in ("context", "eval_batch_size", "eval_batches"):
      if getattr(self, name) is not None:
        check_positive(self, name)

  def resolved(self, gqa: gs.GqaStudy) -> "ToyMeasure":
    """These settings with the defaults from `gqa` filled in; checked against its MHA-big."""
    out = dataclasses.replace(
      self,
      context=self.context or gqa.big.max_len,
      eval_batch_size=self.eval_batch_size or gqa.train.batch_size,
      eval_batches=self.eval_batches or gqa.train.eval_batches,
    )
    if out.context > gqa.big.max_len:
      raise ValueError(f"ToyMeasure.context={out.context} exceeds MHA-big's max_len={gqa.big.max_len}")
    out.recall.check_model(gqa.big.max_len, gqa.big.vocab_size)
    return out


def folder(variant: Variant, gqa: gs.GqaStudy) -> str:
  """The folder of the params a variant runs: MHA-big's, or its uptraining's."""
  if variant.conversion is None:
    return MHA_BIG
  return stages.uptrained_name(variant.conversion, gqa.fraction, variant.distill)


def model_config(variant: Variant, gqa: gs.GqaStudy) -> ModelConfig:
  """The shape of the params a variant runs: MHA-big, or the target of its conversion; a toy
  conversion is uptrained (recovered=True)."""
  if variant.conversion is None:
    return gqa.big
  if not variant.recovered:
    raise ValueError(
      f"Variant {variant.name!r}: a toy study's conversions are uptrained at alpha = gqa.fraction; set recovered=True"
    )
  try:
    return variant.conversion.target(gqa.big)
  except ValueError as err:
    raise ValueError(f"Variant {variant.name!r}: {variant.conversion.name} does not convert MHA-big: {err}") from None


def prepare(
  gqa: gs.GqaStudy, variants, workdir: Path, models_from: str = "", progress: Callable[[str], None] = lambda line: None
) -> dict[str, Path]:
  """{folder: path} of the params of every variant. With models_from, that GQA study's finished
  stages, only read (its recorded settings must be gqa's); otherwise pre-trained and uptrained
  here, each stage reported through `progress`."""
  names = list(dict.fromkeys(folder(v, gqa) for v in variants))
  if models_from:
    root = Path(models_from)
    try:
      done = json.loads((root / "stages.json").read_text())
    except (OSError, ValueError) as err:
      raise ValueError(f"models_from={root} is not a GQA study's workdir: {err}") from None
    diffs = stages.settings_diffs(done.get("study") or {}, gs.stage_settings(gqa), gs.recorded_settings)
    if diffs:
      raise ValueError(f"models_from={root} holds a GQA study with other settings than gqa ({'; '.join(diffs)})")
    missing = [n for n in names if ("pretrain_big" if n == MHA_BIG else n) not in done]
    if missing:
      raise ValueError(
        f"models_from={root} has not finished {missing}: run that study first, "
        "or set models_from='' to train them in this workdir"
      )
    return {name: root / name for name in names}
  study_stages = gs.open_stages(gqa, workdir, progress)
  stages.pretrain(study_stages, "big", gqa.pretraining("big"))
  paths = {MHA_BIG: stages.pretrained(workdir, "big")}
  for variant in variants:
    if variant.conversion is not None:
      paths[folder(variant, gqa)] = stages.uptrained(
        study_stages, paths[MHA_BIG], variant.conversion, gqa.fraction, variant.distill, mesh=gqa.train.mesh
      )
  return {name: paths[name] for name in names}


def bits_per_byte(model, params, data: Dataset, settings: ToyMeasure, cache_config) -> dict:
  """Held-out bits per byte through the cache on the windows of training.evaluate.evaluate: from
  one prefill of each window ("bits_per_byte") and from its first byte prefilled and the rest fed
  one per decode step ("decode_bits_per_byte")."""
  windows = list(eval_batches(data.val, data.seq_len, settings.eval_batch_size, settings.eval_batches))
  scale = math.log(2) * data.bytes_per_token
  prefilled, count = measure.nll(model, params, windows, cache_config, data.seq_len, score_context=True)
  decoded, _ = measure.nll(model, params, windows, cache_config, 1, score_context=True, stepwise=True)
  return {"bits_per_byte": prefilled / count / scale, "decode_bits_per_byte": decoded / count / scale}


def measure_row(model, params, data: Dataset, settings: ToyMeasure, cache_config) -> dict:
  """Every measurement but the timing of one model through one cache; the needles' samples under
  "samples" (one record per needle, with its distance)."""
  row = {
    "kv_bytes_per_token": measure.kv_bytes_per_token(model.config, cache_config, settings.context),
    **bits_per_byte(model, params, data, settings, cache_config),
  }
  found = byte_recall.recall(model, params, settings.recall, data.val, cache_config)
  for distance, result in found.items():
    row[f"recall_{distance}"] = result["exact_match"]
    row[f"recall_bytes_{distance}"] = result["byte_accuracy"]
  row["samples"] = [{"distance": int(d), **r} for d, result in found.items() for r in result["samples"]]
  return row
