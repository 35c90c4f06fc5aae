"""The stages the GQA and KV-frontier studies share, each run once per study workdir: pre-training
an MHA model, uptraining it by a conversion (kvjax.conversion.conversions), and timing models'
generation per sample. A stage's result is cached in WORKDIR/stages.json (Stages), so a rerun
skips finished stages; each pre-training and uptraining claims its own workdir inside it.

Folders: WORKDIR/mha_{which} for a pre-training (stage pretrain_{which}), and for an uptraining
the conversion's name with the uptraining's alpha and distillation weight, e.g.
kv2_pca_alpha0.05_distill1 (its stage has the same name).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.fields import check_positive
from kvjax.conversion.conversions import Conversion
from kvjax.conversion.uptrain import uptrain
from kvjax.decoding import decode
from kvjax.timing import timed_alternating
from kvjax.training import checkpoint, train
from kvjax.training import workdir as workdirs
from kvjax.training.config import TrainRun


@dataclasses.dataclass(frozen=True)
class TimingConfig:
  """One `generate` call per measurement: batch x (prompt + new_tokens) tokens."""

  batch: int = 64
  prompt: int = 64
  new_tokens: int = 448
  repeats: int = 5

  def __post_init__(self):
    check_positive(self, "batch", "prompt", "new_tokens", "repeats")


def settings_diffs(recorded: dict, settings: dict, read_back: Callable[[dict], dict] = lambda d: d) -> list[str]:
  """How the study settings a stages.json recorded differ from `settings` ("key: old -> new"),
  [] when they are the same. read_back(recorded) reads a record as this kvjax writes it (fields
  added since take their defaults), so that only a real change counts."""
  if read_back(recorded) == settings:
    return []
  return checkpoint.config_diffs(recorded, settings) or ["the recorded settings do not read back"]


class Stages:
  """Results of finished stages in WORKDIR/stages.json; `run` computes a stage once, and says
  through `progress` (one line per message) which stage runs, how long it took, or that it was
  done earlier.

  The file records the study settings its results were computed under (`settings`, a dict): a
  rerun with other settings stops with an error instead of reusing them (settings_diffs, with
  `read_back`). The workdir must be claimed as a study's (kvjax.training.workdir.claim_study:
  `kvjax run` does).
  """

  def __init__(
    self,
    workdir: Path,
    settings: dict,
    read_back: Callable[[dict], dict] = lambda d: d,
    progress: Callable[[str], None] = print,
  ):
    if workdirs.held(workdir) != workdirs.STUDY:
      raise ValueError(
        f"{workdir} is not claimed as a study's workdir: run the study with `kvjax run`, "
        "or inside kvjax.training.workdir.claim_study"
      )
    self.workdir = Path(workdir)
    self.progress = progress
    self.path = self.workdir / "stages.json"
    self.done = json.loads(self.path.read_text()) if self.path.exists() else {}
    diffs = settings_diffs(self.done.setdefault("study", settings), settings, read_back)
    if diffs:
      raise ValueError(
        f"{self.path} holds stages of a study with other settings ({'; '.join(diffs)}); run it in another --workdir"
      )

  def run(self, name: str, fn):
    if name in self.done:
      self.progress(f"stage {name}: done earlier (in {self.path.name})")
      return self.done[name]
    self.progress(f"stage {name}: running")
    start = time.perf_counter()
    self.done[name] = fn()
    self.path.write_text(json.dumps(self.done, indent=2) + "\n")
    self.progress(f"stage {name}: done in {time.perf_counter() - start:.0f} s")
    return self.done[name]


def pretrained(workdir: Path, which: str) -> Path:
  """The workdir of a study's pre-training `which` ("small", "big")."""
  return Path(workdir) / f"mha_{which}"


def pretrain(stages: Stages, which: str, config: TrainRun) -> dict:
  """Trains `config` in pretrained(stages' workdir, which), stage pretrain_{which}; its train summary."""
  return stages.run(f"pretrain_{which}", lambda: train.run(config, pretrained(stages.workdir, which)))


def uptrained_name(conversion: Conversion, fraction: float, distill: float = 0.0) -> str:
  """The folder (and stage) name of an uptraining by `conversion` for alpha = fraction."""
  return f"{conversion.name}_alpha{fraction:g}" + (f"_distill{distill:g}" if distill else "")


def uptrained(
  stages: Stages, source: Path, conversion: Conversion, fraction: float, distill: float = 0.0, mesh: str | None = None
) -> Path:
  """Uptrains the checkpoint in `source` by `conversion` (kvjax.conversion.uptrain) in its own
  folder of the stages' workdir, once; returns that folder. The uptraining's record
  (uptrain.json: quality before, at and after) is the stage's result. mesh: train.mesh of the
  uptraining (a mesh is not inherited from the source)."""
  dest = stages.workdir / uptrained_name(conversion, fraction, distill)
  overrides = [f"train.mesh={mesh}"] if mesh else []
  stages.run(
    dest.name, lambda: uptrain(source, dest, conversion, fraction=fraction, distill=distill, overrides=overrides)
  )
  return dest


def time_per_sample(models: dict, timing: TimingConfig, caches: dict | None = None) -> dict:
  """Seconds per sample of jitted greedy `generate` for each of {name: (model, params)}, through
  the cache of caches[name] (a CacheConfig; default: contiguous in the model's dtype).

  After one warm-up call each, the models are timed round-robin, `timing.repeats` rounds, so
  that load from other processes falls on all of them alike; each gets the median of its calls
  divided by the batch.
  """
  caches = {name: (caches or {}).get(name, CacheConfig()) for name in models}
  rng = np.random.default_rng(0)
  vocab = min(model.config.vocab_size for model, _ in models.values())
  prompts = rng.integers(0, vocab, (timing.batch, timing.prompt), dtype=np.int32)
  lengths = np.full((timing.batch,), timing.prompt, np.int32)
  calls = {
    name: (
      lambda m=model, p=params, c=caches[name]: decode.generate(
        m, p, prompts, lengths, timing.new_tokens, cache_config=c
      )
    )
    for name, (model, params) in models.items()
  }
  times = timed_alternating(calls, timing.repeats)
  return {
    name: {
      "time_per_sample_s": statistics.median(times[name]) / timing.batch,
      "times_s": times[name],
      "kv_bytes_per_token": kinds.bytes_per_token(model.config, caches[name]),
      "params": int(sum(x.size for x in jax.tree.leaves(params))),
    }
    for name, (model, params) in models.items()
  }
