"""Pretrained models for the real-model studies (kvjax.studies.kv_frontier, real_gqa, eviction):
the import and the conversions a list of variants runs, and the measurement settings.

Models. The pretrained model (a name `kvjax import` knows, a GGUF file, a Hugging Face folder) is
imported once into WORKDIR/source; each conversion (kvjax.conversion.conversions) of it is run by
kvjax.conversion.uptrain into its own folder, at alpha = 0 (`{name}_alpha0`: converted, not
trained) or recovered (`{name}_{mode}`: Recovery.mode "local", layer-local recovery, or "train",
end-to-end uptraining with distillation); a variant with `distill` > 0 under a layer-local
Recovery with distill_steps is then trained end to end from that recovery with distillation from
the source (`{name}_local_distill`: the paper's path, `kvjax uptrain --init`). Every one is a stage of WORKDIR/stages.json
(kvjax.studies.base.stages), so a rerun skips what is done and an interrupted recovery resumes; with
`models_from`, another study's finished workdir (same source and Recovery) is only read.

Measurements (measure_row), each through the cache a variant names, by kvjax.studies.base.measure:
  kv_bytes_per_token  measure.kv_bytes_per_token at Measure.context;
  perplexity          held-out prose windows of C tokens (pydoc_data prose, which no recovery
                      trains on): the first C/2 prefilled through the cache (a press compresses
                      them, a window drops what leaves it), the last C/2 extended into it and
                      scored; the same tokens for every variant;
  suite               the recall axis: the RULER-style suite's score per context length and
                      their mean, in % (kvjax.studies.suite.axis, Measure.suite: by default the
                      single-needle and multi-key tasks, query-aware);
  passkey             when Measure.passkey is set, pass-key recall per prompt length, in %
                      (kvjax.studies.suite.passkey: the needle at a random depth, the key found in the
                      answer; the whole prompt in one generate, so a press sees the question);
                      every sample of both drawn once per study and written to
                      WORKDIR/samples.jsonl, every variant's answers to WORKDIR/answers.jsonl
                      (kvjax.studies.suite.passkey_run.write_records), "method" the variant's name;
  decode step         one decode step of `batch` rows holding `context` positions, weights stored
                      as Measure.weights (measure.decode_step_ms).

Peers: other pretrained models measured as trained (their own import, the full cache, no
conversion) beside a study's variants, e.g. Gemma 3 270M, MQA as trained with a 512-token window
on five of six layers (prepare's peers, peer_folder, peer_name, attention_kind).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Callable

import numpy as np

from kvjax.cache.config import CacheConfig
from kvjax.conversion.import_model import import_model
from kvjax.conversion.uptrain import uptrain
from kvjax.config import ModelConfig
from kvjax.fields import check_choice, check_nonnegative, check_positive, check_real, from_dict, to_dict
from kvjax.model.weights import check_format, store
from kvjax.studies.base import measure, stages
from kvjax.studies.suite import axis
from kvjax.studies.base.variants import Variant
from kvjax.studies.base.models import tokenized_checkpoint
from kvjax.studies.suite.passkey import TASK as PASSKEY, PasskeyConfig
from kvjax.studies.suite.passkey_run import all_samples, passkey
from kvjax.studies.suite.axis import SuiteConfig
from kvjax.training import checkpoint
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset

SOURCE = "source"
MODES = ("local", "train")


@dataclasses.dataclass(frozen=True)
class Recovery:
  """How a converted model recovers: mode "local" (kvjax.conversion.local: `steps` per layer on
  `windows` calibration windows) or "train" (end-to-end uptraining for `steps` steps with distillation
  weight `distill`); both on windows of seq_len tokens of the first data_bytes bytes of the standard
  library's sources, batch_size windows a step, AdamW at `lr` after warmup_steps.

  distill_steps > 0 (mode "local" only): the variants that ask for it (Variant.distill, the
  distillation weight) then train end to end from the layer-local recovery, distill_steps steps at
  `distill_lr` (warmup alike), held-out loss every distill_eval_every steps (the gap-closed curve,
  kvjax.conversion.curve), a checkpoint at each."""

  mode: str = "local"
  steps: int = 100
  batch_size: int = 8
  lr: float = 1e-3
  warmup_steps: int = 10
  seq_len: int = 256
  distill: float = 1.0
  data_bytes: int = 1_000_000
  windows: int = 256
  distill_steps: int = 0
  distill_lr: float = 1e-4
  distill_eval_every: int = 10

  def __post_init__(self):
    check_choice(self, "mode", MODES)
    check_positive(self, "steps", "batch_size", "seq_len", "data_bytes", "windows", "distill_eval_every")
    check_nonnegative(self, "distill_steps")
    check_real(self, "lr", 0.0, 1.0, open_low=True)
    check_real(self, "distill_lr", 0.0, 1.0, open_low=True)
    check_real(self, "distill", 0.0, 1e6)
    if self.distill_steps and self.mode != "local":
      raise ValueError(
        f"Recovery.distill_steps={self.distill_steps} trains end to end after a layer-local recovery: "
        f"it needs mode 'local', got {self.mode!r}"
      )

  def overrides(self, recovered: bool) -> list[str]:
    """The uptraining's --set overrides: its data and evaluation (2 batches) always; its steps
    and optimizer when it recovers."""
    data = [
      f"data.max_bytes={self.data_bytes}",
      f"data.seq_len={self.seq_len}",
      f"train.batch_size={self.batch_size}",
      "train.eval_batches=2",
    ]
    if not recovered:
      return data
    return data + [
      f"train.steps={self.steps}",
      f"train.lr={self.lr!r}",
      f"train.warmup_steps={min(self.warmup_steps, self.steps)}",
      f"train.eval_every={self.steps}",
      f"train.checkpoint_every={self.steps}",
    ]

  def distill_overrides(self) -> list[str]:
    """The --set overrides of the end-to-end distillation after the layer-local recovery: the same
    data and evaluation (so its held-out losses are comparable with the recovery's own), its
    steps, learning rate and cadence."""
    return self.overrides(False) + [
      f"train.steps={self.distill_steps}",
      f"train.lr={self.distill_lr!r}",
      f"train.warmup_steps={min(self.warmup_steps, self.distill_steps)}",
      f"train.eval_every={self.distill_eval_every}",
      f"train.checkpoint_every={self.distill_eval_every}",
      f"train.log_every={self.distill_eval_every}",
      "train.keep_checkpoints=1",  # a resume needs the latest only; each holds AdamW's state too
    ]


def folder(variant: Variant, recovery: Recovery) -> str:
  """The folder of the params a variant runs: the import, or its conversion's at alpha = 0 or recovered."""
  if variant.conversion is None:
    return SOURCE
  distilled = "_distill" if variant.distill else ""
  return f"{variant.conversion.name}_{recovery.mode if variant.recovered else 'alpha0'}{distilled}"


def stage_settings(source: str, layers: int | None, recovery: Recovery) -> dict:
  """What a workdir's stages.json records: the models depend on these alone."""
  return {"source": source, "layers": layers, "recovery": to_dict(recovery)}


def read_back(recorded: dict) -> dict:
  """stage_settings as this kvjax reads a recorded one: Recovery fields added since take their defaults."""
  try:
    return stage_settings(recorded["source"], recorded["layers"], from_dict(Recovery, recorded["recovery"]))
  except (KeyError, TypeError, ValueError):
    return recorded


def prepare(
  source: str,
  layers: int | None,
  recovery: Recovery,
  wanted: list[Variant],
  workdir: Path,
  models_from: str = "",
  progress: Callable[[str], None] = lambda line: None,
  peers: tuple[str, ...] = (),
) -> dict[str, Path]:
  """{folder: path} of the params of every variant in `wanted`: imported (its first `layers` layers when
  given) and converted (and recovered) here as stages. With models_from (the workdir of a study
  with the same settings), the models it finished are only read from there, the import among
  them, and the rest are made here from its import.

  peers: models measured as trained, each under peer_folder(peer): a kvjax workdir holding a
  checkpoint is read as it is; anything else (a name `kvjax import` knows, a GGUF file, a
  Hugging Face folder) is imported whole, once (a stage), or read from models_from's."""
  settings = stage_settings(source, layers, recovery)
  folders = {folder(v, recovery): v for v in wanted}
  given = {}
  for peer in peers:
    path = Path(peer)
    if path.is_dir() and checkpoint.latest_step(path) is not None:
      given[peer_folder(peer)] = path
  paths, base = {}, workdir / SOURCE
  if models_from:
    root = Path(models_from)
    try:
      done = json.loads((root / "stages.json").read_text())
    except (OSError, ValueError) as err:
      raise ValueError(f"models_from={root} is not a real-model study's workdir: {err}") from None
    diffs = stages.settings_diffs(done.get("study") or {}, settings, read_back)
    if diffs:
      raise ValueError(f"models_from={root} holds models made with other settings ({'; '.join(diffs)})")
    if SOURCE not in done:
      raise ValueError(
        f"models_from={root} has not imported its model yet: run that study first, or set models_from=''"
      )
    paths = {f: root / f for f in [SOURCE, *folders, *map(peer_folder, peers)] if f in done}
    base = root / SOURCE
  for p in folders.values():
    if p.distill and not (recovery.mode == "local" and recovery.distill_steps):
      raise ValueError(
        f"variant {p.name!r} is distilled after a layer-local recovery: it needs Recovery(mode='local', "
        f"distill_steps > 0), got mode {recovery.mode!r}, distill_steps {recovery.distill_steps}"
      )
  run = stages.Stages(workdir, settings, read_back, progress=progress)
  if SOURCE not in paths:
    run.run(SOURCE, lambda: import_model(source, base, layers=layers))

  def make(name: str, p: Variant) -> None:
    if name in paths or p.conversion is None:
      return
    if p.distill:  # after the layer-local recovery of the same conversion, made first
      recovered = dataclasses.replace(p, distill=0.0)
      init = folder(recovered, recovery)
      make(init, recovered)
      kwargs = dict(fraction=1.0, distill=p.distill, init=paths.get(init, workdir / init))
      kwargs["overrides"] = recovery.distill_overrides()
    elif p.recovered:
      kwargs = dict(fraction=1.0, recovery=recovery.mode, overrides=recovery.overrides(True))
      kwargs |= {"local_windows": recovery.windows} if recovery.mode == "local" else {"distill": recovery.distill}
    else:
      kwargs = dict(fraction=0.0, overrides=recovery.overrides(False))
    run.run(name, lambda: uptrain(base, workdir / name, p.conversion, **kwargs))

  for name, p in folders.items():
    make(name, p)
  for peer in peers:
    name = peer_folder(peer)
    if name not in given and name not in paths:
      run.run(name, lambda: import_model(peer, workdir / name))
  return {f: given.get(f) or paths.get(f, workdir / f) for f in [*folders, *map(peer_folder, peers)]}


def stored_config(path: Path) -> ModelConfig:
  """The ModelConfig of a workdir's latest checkpoint, from its metadata (no weights read)."""
  return from_dict(ModelConfig, checkpoint.read_meta(path, checkpoint.latest_step(path))["config"]["model"])


def load(path: Path):
  """(model, params, tokenizer) of a workdir's latest checkpoint."""
  return tokenized_checkpoint(path)


def prose_windows(tokenizer, length: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """`count` held-out prose windows of `length` tokens -> [(inputs, targets) int32 [count, length]]."""
  data = load_dataset(DataConfig(source=PROSE, seq_len=length), tokenizer)
  return list(eval_batches(data.val, length, count, 1))


@dataclasses.dataclass(frozen=True)
class Measure:
  """The shared measurement settings: perplexity on `windows` prose windows of each of `contexts`
  tokens, the `suite` (the recall axis), pass-key recall when `passkey` is set (None: not
  measured), the decode step at `batch` x `context` positions over `repeats` steps with weights
  stored as `weights`."""

  contexts: tuple[int, ...] = (1024, 2048)
  windows: int = 2
  suite: SuiteConfig = dataclasses.field(default_factory=SuiteConfig)
  passkey: PasskeyConfig | None = None
  batch: int = 8
  context: int = 2048
  repeats: int = 3
  weights: str = "int8"

  def __post_init__(self):
    check_positive(self, "windows", "batch", "context", "repeats")
    if not self.contexts or any(not isinstance(c, int) or c < 4 or c % 2 for c in self.contexts):
      raise ValueError(f"Measure.contexts must be even token counts of at least 4, got {self.contexts!r}")
    if not isinstance(self.suite, SuiteConfig):
      raise ValueError(f"Measure.suite must be a SuiteConfig, got {self.suite!r}")
    if self.passkey is not None and not isinstance(self.passkey, PasskeyConfig):
      raise ValueError(f"Measure.passkey must be a PasskeyConfig or None, got {self.passkey!r}")
    check_format(self.weights)


def recall_inputs(tokenizer, settings: Measure, max_len: int, model: str = "") -> list[dict]:
  """Every recall sample of a model's tokenizer: the suite's (marked `model` when given), then
  the pass key's when measured (passkey_run.all_samples)."""
  inputs = axis.samples(tokenizer, settings.suite, max_len, model)
  if settings.passkey is not None:
    inputs += [{**s, "model": model} if model else s for s in all_samples(tokenizer, settings.passkey)]
  return inputs


def recall_row(model, params, tokenizer, cache_config: CacheConfig, settings: Measure, inputs: list[dict], method: str):
  """The recall columns of one model through one cache (inputs: recall_inputs) -> (suite_L and
  suite_mean, and passkey_L and passkey_mean when measured, in %; one result per sample, marked
  `method`)."""
  ruler_inputs = [s for s in inputs if s["task"] != PASSKEY]
  row, records = axis.scores(model, params, tokenizer, cache_config, settings.suite, ruler_inputs, method)
  if settings.passkey is not None:
    keys = [s for s in inputs if s["task"] == PASSKEY]
    found = passkey(model, params, tokenizer, settings.passkey, cache_config=cache_config, inputs=keys, method=method)
    for length, result in found.items():
      row[f"passkey_{length}"] = 100.0 * result["recall"]
    row["passkey_mean"] = statistics.mean(row[f"passkey_{n}"] for n in settings.passkey.lengths)
    marked = {"model": keys[0]["model"]} if "model" in keys[0] else {}  # one model's samples, all marked or none
    records += [{**r, **marked} for result in found.values() for r in result["samples"]]
  return row, records


def measure_row(
  model, params, tokenizer, cache_config: CacheConfig, settings: Measure, windows: dict, inputs: list[dict], method: str
) -> dict:
  """Every measurement of one model through one cache (windows: {C: prose_windows(C)}; inputs:
  recall_inputs); the per-sample results under "samples" (marked `method`)."""
  cache_config = cache_config.bind(tokenizer)
  row = {"kv_bytes_per_token": measure.kv_bytes_per_token(model.config, cache_config, settings.context)}
  for length, ws in windows.items():
    row[f"perplexity_{length}"] = measure.perplexity(model, params, ws, cache_config, length // 2)
  recall, records = recall_row(model, params, tokenizer, cache_config, settings, inputs, method)
  row |= recall
  steps = measure.decode_step_ms(
    model, store(params, settings.weights), cache_config, settings.batch, settings.context, settings.repeats
  )
  row["decode_step_ms"] = statistics.median(steps)
  row["samples"] = records
  return row


def peer_name(peer: str) -> str:
  """A peer's name in rows: a named model's name, a file's or folder's stem."""
  return Path(peer).stem if ("/" in peer or Path(peer).suffix) else peer


def attention_kind(config: ModelConfig) -> str:
  """ "MHA", "MQA" or "GQA-K" for a model of K kv heads."""
  if config.num_kv_heads == 1:
    return "MQA"
  return "MHA" if config.num_kv_heads == config.num_heads else f"GQA-{config.num_kv_heads}"


def peer_folder(peer: str) -> str:
  """The folder prepare imports a peer into: peer_<its name>."""
  return f"peer_{peer_name(peer)}"


def check_peers(peers, where: str) -> None:
  """ValueError naming `where` unless peers is a tuple of distinct non-empty strings."""
  if not isinstance(peers, tuple) or not all(isinstance(p, str) and p for p in peers):
    raise ValueError(f"{where} must be a tuple of model names or paths, got {peers!r}")
  names = [peer_name(p) for p in peers]
  if len(set(names)) != len(names):
    raise ValueError(f"{where} must name distinct models, got {peers!r}")
