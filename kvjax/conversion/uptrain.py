"""Uptraining (Ainslie et al. 2023): convert a trained MHA checkpoint to GQA / MQA, then continue
pre-training for a fraction alpha of the source run's steps (`kvjax uptrain`).

The source workdir is only read. The destination is an ordinary training workdir (resumable like
any run) plus uptrain.json, which records held-out quality before conversion, right after it
(alpha = 0) and after uptraining. A source with a tokenizer.json (an imported model) passes it
on: the destination gets a copy, and evaluation and training there use its token ids. What the
job needs in memory is checked against the machine (kvjax.memory) before the source is loaded.
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
from kvjax.config import ModelConfig, apply_overrides, from_dict, to_dict
from kvjax.conversion.kv_heads import convert_kv_heads
from kvjax.interop.hf import copy_tokenizer, load_tokenizer
from kvjax.training.data import load_dataset
from kvjax.training.evaluate import evaluate
from kvjax.model.transformer import Transformer
from kvjax.training.config import DataConfig, TrainConfig, TrainRun


def uptrain_config(source: dict, source_steps: int, num_kv_heads: int, fraction: float,
                   overrides=()) -> TrainRun:
  """The destination run: the source's model with fewer kv heads, its data and optimizer settings,
  and fraction x source_steps steps (warmup and cadences scaled alike, fresh optimizer state).
  The source's device mesh is not inherited: give one with the override train.mesh=..."""
  model = from_dict(ModelConfig, source.get("model")).replace(num_kv_heads=num_kv_heads)
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


def uptrain(source_workdir: str | Path, workdir: str | Path, num_kv_heads: int, *, method: str = "mean",
            fraction: float = 0.05, overrides=(), seed: int = 0) -> dict:
  """Converts the latest checkpoint of `source_workdir` and uptrains it in `workdir`.

  fraction = 0 stores the converted weights without training (the paper's alpha = 0).
  Returns the record written to workdir/uptrain.json.
  """
  source, dest = Path(source_workdir).resolve(), Path(workdir).resolve()
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
  config = uptrain_config(source_config, step, num_kv_heads, fraction, overrides)
  mesh = sharding.mesh_from_spec(config.train.mesh)
  _check_memory(source_config, config, fraction, mesh)
  # The source model's tokenizer (an imported model's) is the one every step below uses.
  tokenizer = load_tokenizer(source, config.model.vocab_size)
  model, params, _ = checkpoint.load_model(source, step)
  new_params, new_model_config = convert_kv_heads(params, model.config, num_kv_heads, method,
                                                  rng=jax.random.key(seed))

  record_path = dest / "uptrain.json"
  record = json.loads(record_path.read_text()) if record_path.exists() else None
  if record is not None and (record["num_kv_heads"], record["method"], record["fraction"]) != (num_kv_heads, method, fraction):
    raise ValueError(f"{dest} holds an uptraining with kv heads {record['num_kv_heads']}, method "
                     f"{record['method']!r}, fraction {record['fraction']}; use another --workdir")
  data = load_dataset(config.data, tokenizer)
  quality = lambda m, p: evaluate(m, p, data, batch_size=config.train.batch_size,
                                  num_batches=config.train.eval_batches, mesh=mesh)
  if record is None:
    record = {"source": str(source), "source_step": step, "num_kv_heads": num_kv_heads,
              "method": method, "fraction": fraction, "steps": config.train.steps if fraction else 0,
              "before": quality(model, params),
              "converted": quality(Transformer(new_model_config), new_params)}
    dest.mkdir(parents=True, exist_ok=True)
    checkpoint.write_atomically(record_path, json.dumps(record, indent=2) + "\n")
  copy_tokenizer(source, dest)  # before any checkpoint: training and every later eval read it there

  if fraction == 0:
    if checkpoint.latest_step(dest) is None:
      checkpoint.save_params(dest, new_params, new_model_config, run_config=to_dict(config))
    record["after"] = record["converted"]
  else:
    checkpoint.write_atomically(dest / "config.json", json.dumps(to_dict(config), indent=2) + "\n")
    summary = train.run(config, dest, init_params=new_params)
    record["after"] = {"loss": summary["val_loss"], "bits_per_byte": summary["bits_per_byte"],
                       "accuracy": summary["accuracy"]}
  checkpoint.write_atomically(record_path, json.dumps(record, indent=2) + "\n")
  return record
