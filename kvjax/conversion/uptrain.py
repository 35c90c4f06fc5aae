"""Uptraining (Ainslie et al. 2023): convert a trained MHA checkpoint to GQA / MQA, or to
multi-head latent attention (MHA2MLA, kvjax.conversion.mla), then continue pre-training for a
fraction alpha of the source run's steps (`kvjax uptrain`).

The source workdir is only read. The destination is an ordinary training workdir (resumable like
any run) plus uptrain.json, which records held-out quality before conversion, right after it
(alpha = 0) and after uptraining. A source with a tokenizer.json (an imported model) passes it
on: the destination gets a copy, and evaluation and training there use its token ids. What the
job needs in memory is checked against the machine (kvjax.memory) before the source is loaded.
The destination is claimed as an "uptrain" workdir (claim_workdir) whose marker records the
source: its path, step and fingerprint (kvjax.training.workdir.fingerprint of its config and
params); it resumes from that source only, unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax

from kvjax import memory, sharding
from kvjax.training import checkpoint
from kvjax.training import train
from kvjax.training import workdir as workdirs
from kvjax.config import ModelConfig, apply_overrides, check_positive_int, from_dict, to_dict
from kvjax.conversion.kv_heads import convert_kv_heads
from kvjax.conversion.mla import check_target, convert_to_mla
from kvjax.interop.hf_files import copy_tokenizer
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.training.data import WindowSampler, load_dataset
from kvjax.training.evaluate import evaluate
from kvjax.model.transformer import Transformer
from kvjax.training.config import DataConfig, TrainConfig, TrainRun


def uptrain_config(source: dict, source_steps: int, num_kv_heads: int, fraction: float,
                   overrides=(), to_mla: tuple[int, int] | None = None) -> TrainRun:
  """The destination run: the source's model with fewer kv heads (or, with to_mla = (rank,
  rope_dims), its MLA form; the kept frequencies, ModelConfig.rope_pairs, are the conversion's),
  its data and optimizer settings, and fraction x source_steps steps (warmup and cadences scaled
  alike, fresh optimizer state). The source's device mesh is not inherited: give one with the
  override train.mesh=..."""
  model = from_dict(ModelConfig, source.get("model")).replace(num_kv_heads=num_kv_heads)
  if to_mla is not None:
    model = model.replace(kv_latent_rank=to_mla[0], rope_dims=to_mla[1])
  data = from_dict(DataConfig, source["data"]) if "data" in source else DataConfig(seq_len=min(128, model.max_len))
  tc = from_dict(TrainConfig, source["train"]) if "train" in source else TrainConfig()
  steps = max(1, round(fraction * source_steps))
  scale = lambda n: max(1, min(steps, math.ceil(n * fraction)))
  tc = dataclasses.replace(tc, steps=steps, warmup_steps=min(tc.warmup_steps, scale(tc.warmup_steps)),
                           eval_every=scale(tc.eval_every), checkpoint_every=scale(tc.checkpoint_every),
                           log_every=scale(tc.log_every), mesh=None)
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
  with the same settings, whose latest checkpoint's config this run may resume. An uptraining
  written before workdirs were marked is recognised by its uptrain.json, whose source is checked
  by path and step (it records no fingerprint)."""
  def same_job(recorded: dict) -> None:
    if recorded.get("source") != source:
      was = recorded.get("source") or {}
      if was.get("path") != source["path"]:
        raise workdirs.WorkdirRefused(f"{dest} holds an uptraining of {_describe(was)}, not of {_describe(source)}; "
                                      f"uptrain {source['path']} in another --workdir")
      if was.get("fingerprint") is not None or was.get("step") != source["step"]:
        raise workdirs.WorkdirRefused(f"{dest} holds an uptraining of {_describe(was)}, and that source has changed "
                                      f"since: it is now {_describe(source)}; uptrain it in another --workdir")
    shown = {k: recorded.get(k) for k in settings}
    if shown != settings:
      raise workdirs.WorkdirRefused(f"{dest} holds an uptraining with {_settings(shown)}, not {_settings(settings)}; "
                                    "use another --workdir")
    if checkpoint.latest_step(dest) is not None:
      checkpoint.check_resume(checkpoint.read_meta(dest), config, dest)

  def legacy(path: Path) -> bool:
    try:
      record = json.loads((path / "uptrain.json").read_text())
    except (OSError, ValueError):
      return False
    if not isinstance(record, dict) or not isinstance(record.get("source"), str):
      return False
    # It records neither a fingerprint nor the seed of --method random.
    source_then = {"path": record["source"], "step": record.get("source_step"), "fingerprint": None}
    same_job({"seed": settings.get("seed"), **record, "source": source_then})
    return True

  job = {"source": source, **settings, "config": config}
  return workdirs.claim(dest, workdirs.UPTRAIN, job, same_job=same_job, legacy=legacy)


def _describe(source: dict) -> str:
  fingerprint = source.get("fingerprint")
  return (f"{source.get('path')} at step {source.get('step')}"
          + (f" (fingerprint {fingerprint[:12]})" if fingerprint else ""))


def _settings(settings: dict) -> str:
  return ", ".join(f"{k.replace('num_', '').replace('_', ' ')} {v!r}" for k, v in settings.items())


CALIBRATION_WINDOWS = 64  # training windows whose activations the data-aware conversions fit


def uptrain(source_workdir: str | Path, workdir: str | Path, num_kv_heads: int | None = None, *,
            method: str = "mean", fraction: float = 0.05, distill: float = 0.0, overrides=(), seed: int = 0,
            to_mla: tuple[int, int] | None = None) -> dict:
  """Converts the latest checkpoint of `source_workdir` and uptrains it in `workdir`.

  The conversion is to num_kv_heads kv heads by `method` (kvjax.conversion.kv_heads), or, with
  to_mla = (rank, rope_dims) and num_kv_heads None, to multi-head latent attention
  (convert_to_mla, calibrated like the data-aware methods; `method` is not used).

  fraction = 0 stores the converted weights without training (the paper's alpha = 0). The
  data-aware methods ("pca", "regroup") fit their bases to CALIBRATION_WINDOWS windows of the
  source run's training data. distill > 0 adds distill x KL to the source model's next-token
  distribution to the uptraining loss (TrainConfig.distill).
  Returns the record written to workdir/uptrain.json.
  """
  source, dest = Path(source_workdir).resolve(), workdirs.resolve(workdir)
  if source == dest or source in dest.parents:
    raise ValueError(f"--workdir {dest} must be outside the source workdir {source}, which is never modified")
  if not 0 <= fraction <= 1:
    raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
  step = checkpoint.latest_step(source)
  if step is None:
    raise ValueError(f"no checkpoint in source workdir {checkpoint.checkpoint_dir(source)}")
  if fraction > 0 and step == 0 and not any(o.startswith("train.steps=") for o in overrides):
    raise ValueError(f"the checkpoint in {source} records no pre-training steps (step 0); "
                     "give the uptraining length with --set train.steps=N")
  source_config = checkpoint.read_meta(source, step)["config"]
  source_model = from_dict(ModelConfig, source_config["model"])
  source_kv = source_model.num_kv_heads
  if to_mla is not None:
    if num_kv_heads is not None:
      raise ValueError("give either num_kv_heads (GQA / MQA) or to_mla (MLA), not both")
    if not (isinstance(to_mla, (tuple, list)) and len(to_mla) == 2):
      raise ValueError(f"to_mla must be (rank, rope_dims), got {to_mla!r}")
    to_mla = tuple(to_mla)
    check_target(source_model, *to_mla)
    num_kv_heads = source_kv
  check_positive_int(num_kv_heads, "num_kv_heads")
  if source_kv % num_kv_heads:
    raise ValueError(f"cannot convert {source_kv} kv heads to {num_kv_heads}: the target must divide "
                     f"the source's number of kv heads ({source_kv})")
  config = uptrain_config(source_config, step, num_kv_heads, fraction, (f"train.distill={distill!r}", *overrides),
                          to_mla=to_mla)
  mesh = sharding.mesh_from_spec(config.train.mesh)
  _check_memory(source_config, config, fraction, mesh)
  # The source model's tokenizer (an imported model's) is the one every step below uses.
  tokenizer = TextTokenizer.load(source, config.model.vocab_size)
  model, params, _ = checkpoint.load_model(source, step)
  data = load_dataset(config.data, tokenizer)
  calibration = WindowSampler(data.train, data.seq_len, CALIBRATION_WINDOWS, config.data.seed + 1).next()[0]
  if to_mla is None:
    new_params, new_model_config = convert_kv_heads(params, model.config, num_kv_heads, method,
                                                    rng=jax.random.key(seed), calibration=calibration)
    settings = {"num_kv_heads": num_kv_heads, "method": method, "fraction": fraction} | (
        {"seed": seed} if method == "random" else {})
  else:
    new_params, new_model_config = convert_to_mla(params, model.config, *to_mla, calibration=calibration)
    config = dataclasses.replace(config, model=config.model.replace(rope_pairs=new_model_config.rope_pairs))
    settings = {"kv_latent_rank": to_mla[0], "rope_dims": to_mla[1], "fraction": fraction}
    method = "mla"
  settings |= {"distill": distill} if distill else {}
  source_id = {"path": str(source), "step": step, "fingerprint": workdirs.fingerprint(source_config, params)}
  with claim_workdir(dest, source_id, settings, to_dict(config)):
    record_path = dest / "uptrain.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else None
    quality = lambda m, p: evaluate(m, p, data, batch_size=config.train.batch_size,
                                    num_batches=config.train.eval_batches, mesh=mesh)
    if record is None:
      record = {"source": str(source), "source_step": step, "num_kv_heads": num_kv_heads,
                "method": method, **({"kv_latent_rank": to_mla[0], "rope_dims": to_mla[1]} if to_mla else {}), "fraction": fraction, "distill": distill, "steps": config.train.steps if fraction else 0,
                "before": quality(model, params),
                "converted": quality(Transformer(new_model_config), new_params)}
      checkpoint.write_atomically(record_path, json.dumps(record, indent=2) + "\n")
    copy_tokenizer(source, dest)  # before any checkpoint: training and every later eval read it there

    if fraction == 0:
      if checkpoint.latest_step(dest) is None:
        checkpoint.save_params(dest, new_params, new_model_config, run_config=to_dict(config))
      record["after"] = record["converted"]
    else:
      checkpoint.write_atomically(dest / "config.json", json.dumps(to_dict(config), indent=2) + "\n")
      summary = train.run(config, dest, init_params=new_params, teacher=(model, params))
      record["after"] = {"loss": summary["val_loss"], "bits_per_byte": summary["bits_per_byte"],
                         "accuracy": summary["accuracy"]}
    checkpoint.write_atomically(record_path, json.dumps(record, indent=2) + "\n")
  return record
