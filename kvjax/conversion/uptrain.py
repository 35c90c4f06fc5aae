"""Uptraining (Ainslie et al. 2023): convert a trained checkpoint by a conversion
(kvjax.conversion.conversions: to fewer kv heads, or to multi-head latent attention), then
continue pre-training for a fraction alpha of the source run's steps (`kvjax uptrain`), or recover
layer by layer: each converted attention learns the source layer's output
(kvjax.conversion.local, `--recovery local`).

The source workdir is only read. The destination is an ordinary training workdir (resumable like
any run) plus uptrain.json, which records the conversion and held-out quality before it, right
after it (alpha = 0) and after uptraining. A source with a tokenizer.json (an imported model)
passes it on: the destination gets a copy, and evaluation and training there use its token ids.

What the job needs in memory is checked against the machine (kvjax.memory) before the source is
loaded. The destination is claimed as an "uptrain" workdir (claim_workdir) whose marker records
the source (its path, step and fingerprint: kvjax.training.workdir.fingerprint of its config and
params) and the settings (the conversion's dict, fraction, distillation weight); it resumes from
that source with those settings only.

The paper's path after a layer-local recovery: `init` (`kvjax uptrain --init RECOVERED`) starts the
end-to-end uptraining from the params of a finished uptraining of the same source by the same
conversion (a layer-local recovery), not from the freshly converted ones; the distillation
teacher is still the source model. uptrain.json then records the init's quality ("recovered")
beside before / converted / after, and every end-to-end uptraining records the gap it closed
against its steps ("curve", kvjax.conversion.curve) from its held-out evaluations.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from kvjax import memory, sharding
from kvjax.training import checkpoint
from kvjax.training import train
from kvjax.training import workdir as workdirs
from kvjax.config import ModelConfig
from kvjax.fields import apply_overrides, from_dict, to_dict
from kvjax.conversion import curve, local
from kvjax.conversion.conversions import KINDS, Conversion, from_record
from kvjax.interop.hf_files import copy_tokenizer
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.training.data import WindowSampler, load_dataset
from kvjax.training.evaluate import evaluate
from kvjax.model.transformer import Transformer
from kvjax.training.config import DataConfig, TrainConfig, TrainRun


def uptrain_config(source: dict, source_steps: int, conversion: Conversion, fraction: float, overrides=()) -> TrainRun:
  """The destination run: the source's model as `conversion` targets it (conversion.target, a
  ValueError naming what does not fit), its data and optimizer settings, and fraction x
  source_steps steps (warmup and cadences scaled alike, fresh optimizer state). The source's
  device mesh is not inherited: give one with the override train.mesh=..."""
  model = conversion.target(from_dict(ModelConfig, source.get("model")))
  data = from_dict(DataConfig, source["data"]) if "data" in source else DataConfig(seq_len=min(128, model.max_len))
  tc = from_dict(TrainConfig, source["train"]) if "train" in source else TrainConfig()
  steps = max(1, round(fraction * source_steps))
  scale = lambda n: max(1, min(steps, math.ceil(n * fraction)))
  tc = dataclasses.replace(
    tc,
    steps=steps,
    warmup_steps=min(tc.warmup_steps, scale(tc.warmup_steps)),
    eval_every=scale(tc.eval_every),
    checkpoint_every=scale(tc.checkpoint_every),
    log_every=scale(tc.log_every),
    mesh=None,
  )
  return apply_overrides(TrainRun(job="uptrain", model=model, data=data, train=tc), list(overrides))


def _check_memory(source_config: dict, config: TrainRun, fraction: float, mesh) -> None:
  """Refuses, before loading anything, an uptraining that cannot fit: the source's weights stay
  loaded beside the converted ones and, when it trains, their gradients, AdamW moments and
  activations."""
  source_model = from_dict(ModelConfig, source_config.get("model"))
  need = {"source parameters": memory.param_bytes(source_model)}
  if fraction > 0:
    need |= memory.train_parts(config.model, config.train.batch_size, config.data.seq_len)
  else:
    need["converted parameters"] = memory.param_bytes(config.model)
  memory.check_fits("uptraining", need, devices=None if mesh is None else list(mesh.devices.flat))


def claim_workdir(dest: Path, source: dict, settings: dict, config: dict):
  """kvjax.training.workdir.claim of an uptraining's workdir, a context manager: new or empty, or
  holding an uptraining of the same source (path, step and fingerprint of its config and params)
  with the same settings, whose latest checkpoint's config this run may resume."""

  def same_job(recorded: dict) -> None:
    if recorded.get("source") != source:
      was = recorded.get("source") or {}
      if was.get("path") != source["path"]:
        raise workdirs.WorkdirRefused(
          f"{dest} holds an uptraining of {_describe(was)}, not of {_describe(source)}; "
          f"uptrain {source['path']} in another --workdir"
        )
      raise workdirs.WorkdirRefused(
        f"{dest} holds an uptraining of {_describe(was)}, and that source has changed "
        f"since: it is now {_describe(source)}; uptrain it in another --workdir"
      )
    shown = {k: recorded.get(k) for k in settings}
    if shown != settings:
      raise workdirs.WorkdirRefused(
        f"{dest} holds an uptraining with {_settings(shown)}, not {_settings(settings)}; use another --workdir"
      )
    if checkpoint.latest_step(dest) is not None:
      checkpoint.check_resume(checkpoint.read_meta(dest), config, dest)

  job = {"source": source, **settings, "config": config}
  return workdirs.claim(dest, workdirs.UPTRAIN, job, same_job=same_job)


def _describe(source: dict) -> str:
  fingerprint = source.get("fingerprint")
  return f"{source.get('path')} at step {source.get('step')}" + (
    f" (fingerprint {fingerprint[:12]})" if fingerprint else ""
  )


def _settings(settings: dict) -> str:
  def shown(key, value):
    if key == "init":
      return _describe(value)
    try:
      return from_record(value).name if key == "conversion" else repr(value)
    except ValueError:
      return repr(value)

  return ", ".join(f"{key} {shown(key, value)}" for key, value in settings.items())


CALIBRATION_WINDOWS = 64  # training windows whose activations the data-aware conversions fit
LOCAL_WINDOWS = 256  # training windows layer-local recovery learns from (kvjax.conversion.local)
RECOVERIES = ("train", "local")


def uptrain(
  source_workdir: str | Path,
  workdir: str | Path,
  conversion: Conversion,
  *,
  fraction: float = 0.05,
  distill: float = 0.0,
  recovery: str = "train",
  local_windows: int = LOCAL_WINDOWS,
  init: str | Path | None = None,
  overrides=(),
) -> dict:
  """Converts the latest checkpoint of `source_workdir` by `conversion` and uptrains it in `workdir`.

  A conversion that needs calibration (conversion.needs_calibration: KVHeads pca / regroup,
  ToMLA) fits it to CALIBRATION_WINDOWS windows of the source run's training data. fraction = 0
  stores the converted weights without training (the paper's alpha = 0). distill > 0 adds
  distill x KL to the source model's next-token distribution to the uptraining loss
  (TrainConfig.distill). init (recovery "train" only): the workdir of a finished uptraining of
  this source by this conversion whose params the training starts from (check_init).
  Returns the record written to workdir/uptrain.json.
  """
  if not isinstance(conversion, KINDS):
    raise ValueError(f"conversion must be a KVHeads or ToMLA (kvjax.conversion.conversions), got {conversion!r}")
  source, dest = Path(source_workdir).resolve(), workdirs.resolve(workdir)
  if source == dest or source in dest.parents:
    raise ValueError(f"--workdir {dest} must be outside the source workdir {source}, which is never modified")
  if not 0 <= fraction <= 1:
    raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
  if recovery not in RECOVERIES:
    raise ValueError(f"recovery must be one of {RECOVERIES}, got {recovery!r}")
  if recovery == "local" and (
    isinstance(local_windows, bool) or not isinstance(local_windows, int) or local_windows < 1
  ):
    raise ValueError(f"local_windows must be a positive number of calibration windows, got {local_windows!r}")
  if recovery == "local" and distill:
    raise ValueError(
      f"distill={distill} adds to end-to-end training; recovery 'local' learns from the source layers alone"
    )
  if init is not None and (recovery != "train" or fraction == 0):
    raise ValueError(
      f"init={init} starts an end-to-end uptraining (recovery 'train', fraction > 0), "
      f"not recovery {recovery!r} at fraction {fraction}"
    )
  workdirs.check(dest, workdirs.UPTRAIN)  # a file, a folder of other things: refused before any loading
  step = checkpoint.latest_step(source)
  if step is None:
    raise ValueError(f"no checkpoint in source workdir {checkpoint.checkpoint_dir(source)}")
  if fraction > 0 and step == 0 and not any(o.startswith("train.steps=") for o in overrides):
    raise ValueError(
      f"the checkpoint in {source} records no pre-training steps (step 0); "
      "give the uptraining length with --set train.steps=N"
    )
  source_config = checkpoint.read_meta(source, step)["config"]
  config = uptrain_config(source_config, step, conversion, fraction, (f"train.distill={distill!r}", *overrides))
  mesh = sharding.mesh_from_spec(config.train.mesh)
  _check_memory(source_config, config, fraction, mesh)
  # The source model's tokenizer (an imported model's) is the one every step below uses.
  tokenizer = TextTokenizer.load(source, config.model.vocab_size)
  model, params, _ = checkpoint.load_model(source, step)
  data = load_dataset(config.data, tokenizer)
  calibration = (
    WindowSampler(data.train, data.seq_len, CALIBRATION_WINDOWS, config.data.seed + 1).next()[0]
    if conversion.needs_calibration
    else None
  )
  new_params, new_model_config = conversion.convert(params, model.config, calibration)
  # What the conversion chose from the data (MLA's kept frequencies, rope_pairs) joins the run's model.
  target = conversion.target(model.config)
  chosen = {
    f.name: getattr(new_model_config, f.name)
    for f in dataclasses.fields(target)
    if getattr(new_model_config, f.name) != getattr(target, f.name)
  }
  config = dataclasses.replace(config, model=config.model.replace(**chosen))
  settings = (
    {"conversion": to_dict(conversion), "fraction": fraction}
    | ({"distill": distill} if distill else {})
    | ({"recovery": recovery, "local_windows": local_windows} if recovery == "local" else {})
  )
  source_id = {"path": str(source), "step": step, "fingerprint": workdirs.fingerprint(source_config, params)}
  if init is not None:
    init_id, init_model, init_params = check_init(Path(init), source_id, conversion, config.model)
    settings["init"] = init_id
  with claim_workdir(dest, source_id, settings, to_dict(config)):
    record_path = dest / "uptrain.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else None
    quality = lambda m, p: evaluate(
      m, p, data, batch_size=config.train.batch_size, num_batches=config.train.eval_batches, mesh=mesh
    )
    if record is None:
      record = {
        "source": str(source),
        "source_step": step,
        "conversion": to_dict(conversion),
        "fraction": fraction,
        "distill": distill,
        "recovery": recovery,
        "steps": config.train.steps if fraction else 0,
        "before": quality(model, params),
        "converted": quality(Transformer(new_model_config), new_params),
      }
      if init is not None:
        record["init"] = init_id
        record["recovered"] = quality(init_model, init_params)
      checkpoint.write_atomically(record_path, json.dumps(record, indent=2) + "\n")
    copy_tokenizer(source, dest)  # before any checkpoint: training and every later eval read it there

    if fraction == 0:
      if checkpoint.latest_step(dest) is None:
        checkpoint.save_params(dest, new_params, new_model_config, run_config=to_dict(config))
      record["after"] = record["converted"]
    elif recovery == "local":
      # A recovery resumes only under the settings it began with (its steps, data, optimizer).
      saved = dest / "config.json"
      if saved.exists() and (diffs := checkpoint.config_diffs(json.loads(saved.read_text()), to_dict(config))):
        raise ValueError(
          f"{dest} holds a layer-local recovery with other settings ({'; '.join(diffs)}); use another --workdir"
        )
      checkpoint.write_atomically(saved, json.dumps(to_dict(config), indent=2) + "\n")
      if checkpoint.latest_step(dest) is None:
        windows = WindowSampler(data.train, data.seq_len, local_windows, config.data.seed + 2).next()[0]
        recovered, _ = local.recover((model, params), (new_model_config, new_params), windows, config.train, dest)
        checkpoint.save_params(dest, recovered, new_model_config, step=config.train.steps, run_config=to_dict(config))
      new_model, recovered, _ = checkpoint.load_model(dest)
      record["layers"] = json.loads((dest / local.LOG).read_text())
      record["after"] = quality(new_model, recovered)
    else:
      checkpoint.write_atomically(dest / "config.json", json.dumps(to_dict(config), indent=2) + "\n")
      start = new_params if init is None else init_params
      summary = train.run(config, dest, init_params=start, teacher=(model, params))
      record["curve"] = curve.gap_closed_curve(
        record["converted"]["loss"],
        record["before"]["loss"],
        record.get("recovered", record["converted"])["loss"],
        curve.eval_lines(dest / "metrics.jsonl"),
      )
      record["after"] = {
        "loss": summary["val_loss"],
        "bits_per_byte": summary["bits_per_byte"],
        "accuracy": summary["accuracy"],
      }
    checkpoint.write_atomically(record_path, json.dumps(record, indent=2) + "\n")
  return record


def check_init(init: Path, source: dict, conversion: Conversion, target: ModelConfig):
  """(its id {path, step, fingerprint, recovery}, model, params) of the finished uptraining in
  `init` that an end-to-end uptraining starts from; a ValueError naming init and what differs
  when it is not an uptraining of `source` (path, step, fingerprint) by `conversion` into a model
  of config `target`."""
  init = init.resolve()
  marker = init / workdirs.MARKER
  try:
    recorded = json.loads(marker.read_text())
  except (OSError, ValueError):
    raise ValueError(f"--init {init} is not an uptraining's workdir (no readable {workdirs.MARKER})") from None
  job = recorded.get("job") or {}
  if recorded.get("kind") != workdirs.UPTRAIN:
    raise ValueError(f"--init {init} is a {recorded.get('kind')!r} workdir, not an uptraining's")
  if job.get("source") != source:
    raise ValueError(
      f"--init {init} is an uptraining of {_describe(job.get('source') or {})}, not of {_describe(source)}"
    )
  if job.get("conversion") != to_dict(conversion):
    raise ValueError(f"--init {init} holds {_settings({'conversion': job.get('conversion')})}, not {conversion.name}")
  step = checkpoint.latest_step(init)
  try:
    finished = "after" in json.loads((init / "uptrain.json").read_text())
  except (OSError, ValueError):
    finished = False
  if step is None or not finished:
    raise ValueError(f"--init {init} holds no finished uptraining: run it to the end first")
  model, params, config = checkpoint.load_model(init, step)
  if diffs := checkpoint.config_diffs(to_dict(model.config), to_dict(target)):
    raise ValueError(f"--init {init} holds a model other than this run's ({'; '.join(diffs)})")
  init_id = {
    "path": str(init),
    "step": step,
    "fingerprint": workdirs.fingerprint(config, params),
    "recovery": job.get("recovery", "train"),
  }
  return init_id, model, params
