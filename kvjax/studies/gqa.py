"""The GQA paper's study (Ainslie et al. 2023): pre-train MHA models, uptrain MHA-big into GQA /
MQA, and measure inference time against quality. The drivers in experiments/gqa_*.py compose
these pieces; every stage is cached in WORKDIR/stages.json, so a rerun skips finished stages.

Naming follows the paper: MHA-small plays T5-Large, MHA-big plays T5-XXL; GQA-k and MQA rows are
named by their kv heads. Time per sample is the wall time of one jitted `generate` call divided
by the batch, with batch and lengths chosen so that reading the KV cache dominates each decode
step, as in the paper's large-batch TPU measurements.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import jax
import numpy as np

from kvjax.training import checkpoint
from kvjax.decoding import decode
from kvjax.training import train
from kvjax.training import workdir as workdirs
from kvjax.timing import timed_alternating
from kvjax.config import OMIT_DEFAULT, ModelConfig, check_choice, check_positive, check_real, from_dict, to_dict
from kvjax.conversion.kv_heads import METHODS
from kvjax.conversion.mla import check_target
from kvjax.training.data import load_dataset
from kvjax.training.evaluate import evaluate
from kvjax.training.config import DataConfig, TrainConfig, TrainRun
from kvjax.conversion.uptrain import uptrain
from kvjax.studies import report, tasks
from kvjax.studies.tasks import TaskConfig

# Table 1 of the paper: inference time per sample (s) and average score over its tasks.
PAPER_TABLE = (
    ("MHA-Large", 0.37, 46.0),
    ("MHA-XXL", 1.51, 47.2),
    ("MQA-XXL", 0.24, 46.6),
    ("GQA-8-XXL", 0.28, 47.1),
)


@dataclasses.dataclass(frozen=True)
class TimingConfig:
  """One `generate` call per measurement: batch x (prompt + new_tokens) tokens."""

  batch: int = 64
  prompt: int = 64
  new_tokens: int = 448
  repeats: int = 5

  def __post_init__(self):
    check_positive(self, "batch", "prompt", "new_tokens", "repeats")


@dataclasses.dataclass(frozen=True)
class GqaStudy:
  """Shared by the table and the figures. `gqa_kv_heads` defaults to big.num_heads // 8, the
  paper's 8 query heads per kv head; `fractions` and `methods` drive Figures 5 and 4.
  `best_method` with `distill` (kvjax uptrain --method --distill) makes the table's rows beyond
  the paper's mean-pooled ones; `tasks` is the fine-tune protocol every row is scored by.
  `mla_rows` adds multi-head latent attention rows: each (kv_heads, rope_dims) is MHA-big
  converted to MLA with rope_dims rotary dims and the latent rank that gives exactly the KV bytes
  per token of kv_heads kv heads (`mla_rank`), uptrained as the best_method rows are."""

  job: str = "gqa_table"
  small: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(num_heads=4, num_kv_heads=4))
  big: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(num_heads=16, num_kv_heads=16))
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  timing: TimingConfig = dataclasses.field(default_factory=TimingConfig)
  gqa_kv_heads: int = 0
  fraction: float = 0.05
  fractions: tuple[float, ...] = (0.0, 0.05, 0.1)
  methods: tuple[str, ...] = ("mean", "first", "random", "pca", "regroup")
  best_method: str = "pca"
  distill: float = 1.0
  tasks: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  # Written out only when set, so the configs of earlier runs read as before; a stage selector.
  mla_rows: tuple[tuple[int, int], ...] = dataclasses.field(default=(), metadata=OMIT_DEFAULT)

  def __post_init__(self):
    for name in ("small", "big"):
      cfg = getattr(self, name)
      if cfg.num_kv_heads != cfg.num_heads:
        raise ValueError(f"GqaStudy.{name} must be MHA (num_kv_heads == num_heads), got "
                         f"{cfg.num_kv_heads} kv heads for {cfg.num_heads} heads")
    if self.gqa_kv_heads == 0:
      object.__setattr__(self, "gqa_kv_heads", max(1, self.big.num_heads // 8))
    check_positive(self, "gqa_kv_heads")
    if self.big.num_heads % self.gqa_kv_heads:
      raise ValueError(f"GqaStudy.gqa_kv_heads={self.gqa_kv_heads} must divide big.num_heads={self.big.num_heads}")
    check_real(self, "fraction", 0.0, 1.0)
    if any(not 0 <= f <= 1 for f in self.fractions):
      raise ValueError(f"GqaStudy.fractions must lie in [0, 1], got {self.fractions!r}")
    check_choice(self, "best_method", METHODS)
    if unknown := set(self.methods) - set(METHODS):
      raise ValueError(f"GqaStudy.methods has unknown methods {sorted(unknown)}; choose from {METHODS}")
    check_real(self, "distill", 0.0, 1e6)
    if not isinstance(self.mla_rows, tuple) or not all(isinstance(r, tuple) and len(r) == 2 for r in self.mla_rows):
      raise ValueError(f"GqaStudy.mla_rows must be a tuple of (kv_heads, rope_dims) pairs, got {self.mla_rows!r}")
    for kv, rope in self.mla_rows:
      if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or self.big.num_heads % kv:
        raise ValueError(f"GqaStudy.mla_rows: kv_heads={kv!r} must divide big.num_heads={self.big.num_heads}")
      try:
        check_target(self.big, mla_rank(self.big, kv, rope), rope)
      except ValueError as err:
        raise ValueError(f"GqaStudy.mla_rows: ({kv}, {rope}) does not convert MHA-big to MLA: {err}") from None

  def row_name(self, num_kv_heads: int) -> str:
    if num_kv_heads == self.big.num_heads:
      return "MHA-big"
    return "MQA-big" if num_kv_heads == 1 else f"GQA-{num_kv_heads}-big"


def mla_rank(big: ModelConfig, kv_heads: int, rope_dims: int) -> int:
  """The latent rank at which MLA with rope_dims rotary dims caches exactly the bytes per token of
  `big` with kv_heads kv heads: per layer rank + rope_dims = 2 x kv_heads x head_dim. ValueError
  when that leaves no latent."""
  rank = 2 * kv_heads * big.head_dim - rope_dims
  if rank <= 0:
    raise ValueError(f"rope_dims={rope_dims} leaves no latent at the bytes of {kv_heads} kv heads "
                     f"(2 x {kv_heads} x head_dim={big.head_dim} = {2 * kv_heads * big.head_dim} per layer)")
  return rank


# Fields that only select which stages run (the table and each figure share one workdir).
STAGE_SELECTORS = ("job", "fractions", "methods", "mla_rows")


def stage_settings(study: GqaStudy) -> dict:
  """What WORKDIR/stages.json records of a study: every field but the STAGE_SELECTORS."""
  return {k: v for k, v in to_dict(study).items() if k not in STAGE_SELECTORS}


def recorded_settings(recorded: dict) -> dict:
  """A stages.json's recorded study as this kvjax writes it: read back through GqaStudy, so that
  a field added since (window, sink_tokens, ...) takes its default instead of reading as a
  change. A record this kvjax cannot read is returned as it is (and then differs)."""
  try:
    return stage_settings(from_dict(GqaStudy, recorded))
  except (ValueError, TypeError):
    return recorded


class Stages:
  """Results of finished stages in WORKDIR/stages.json; `run` computes a stage once.

  The file records the study it belongs to: a rerun with other models, data, training or timing
  settings stops with an error instead of reusing results computed under the old ones. The
  workdir must be claimed as a study's (kvjax.training.workdir.claim_study: `kvjax run` does);
  each pre-training and uptraining claims its own workdir inside it.
  """

  def __init__(self, workdir: Path, study: GqaStudy):
    if workdirs.held(workdir) != workdirs.STUDY:
      raise ValueError(f"{workdir} is not claimed as a study's workdir: run the study with `kvjax run`, "
                       "or inside kvjax.training.workdir.claim_study")
    self.path = workdir / "stages.json"
    self.done = json.loads(self.path.read_text()) if self.path.exists() else {}
    current = stage_settings(study)
    recorded = self.done.setdefault("study", current)
    if recorded_settings(recorded) != current:
      diffs = checkpoint.config_diffs(recorded, current)
      raise ValueError(f"{self.path} holds stages of a study with other settings ({'; '.join(diffs)}); "
                       "run it in another --workdir")

  def run(self, name: str, fn):
    if name not in self.done:
      print(f"== stage {name}", flush=True)
      self.done[name] = fn()
      self.path.write_text(json.dumps(self.done, indent=2) + "\n")
    return self.done[name]


def pretrain(study: GqaStudy, stages: Stages, workdir: Path, which: str) -> dict:
  """Pre-trains MHA-small or MHA-big in WORKDIR/mha_{which}; returns its train summary."""
  config = TrainRun(model=getattr(study, which), data=study.data, train=study.train)
  return stages.run(f"pretrain_{which}", lambda: train.run(config, workdir / f"mha_{which}"))


def uptrained_name(study: GqaStudy, num_kv_heads: int, method: str = "mean", fraction: float | None = None,
                   distill: float = 0.0) -> str:
  """The folder (and stage) name of an uptraining of MHA-big inside the study's workdir."""
  fraction = study.fraction if fraction is None else fraction
  return f"kv{num_kv_heads}_{method}_alpha{fraction:g}" + (f"_distill{distill:g}" if distill else "")


def uptrained(study: GqaStudy, stages: Stages, workdir: Path, num_kv_heads: int,
              method: str = "mean", fraction: float | None = None, distill: float = 0.0) -> Path:
  """Uptrains MHA-big to `num_kv_heads` in its own workdir; returns that workdir."""
  fraction = study.fraction if fraction is None else fraction
  dest = workdir / uptrained_name(study, num_kv_heads, method, fraction, distill)
  mesh = [f"train.mesh={study.train.mesh}"] if study.train.mesh else []
  stages.run(dest.name, lambda: uptrain(workdir / "mha_big", dest, num_kv_heads, method=method,
                                        fraction=fraction, distill=distill, overrides=mesh))
  return dest


def mla_name(study: GqaStudy, rank: int, rope_dims: int, fraction: float | None = None,
             distill: float = 0.0) -> str:
  """The folder (and stage) name of an uptraining of MHA-big to MLA (latent rank + rotary dims)."""
  fraction = study.fraction if fraction is None else fraction
  return f"mla_r{rank}_rope{rope_dims}_alpha{fraction:g}" + (f"_distill{distill:g}" if distill else "")


def uptrained_mla(study: GqaStudy, stages: Stages, workdir: Path, rank: int, rope_dims: int,
                  fraction: float | None = None, distill: float = 0.0) -> Path:
  """Converts MHA-big to MLA (convert_to_mla, calibrated on its training data as the data-aware
  GQA methods are) and uptrains it as `uptrained` does, in its own workdir; returns that workdir."""
  fraction = study.fraction if fraction is None else fraction
  dest = workdir / mla_name(study, rank, rope_dims, fraction, distill)
  mesh = [f"train.mesh={study.train.mesh}"] if study.train.mesh else []
  stages.run(dest.name, lambda: uptrain(workdir / "mha_big", dest, to_mla=(rank, rope_dims), fraction=fraction,
                                        distill=distill, overrides=mesh))
  return dest


def task_scores(study: GqaStudy, stages: Stages, workdirs_by_name: dict[str, Path]) -> dict[str, dict]:
  """The paper's protocol (a stage per model): each model fine-tuned on each downstream task for
  the same study.tasks.steps and scored on that task's held-out split (kvjax.studies.tasks);
  {name: {task: score, ..., "avg_score": mean over tasks}}."""
  out = {}
  for name, path in workdirs_by_name.items():
    def run(path=path):
      model, params, _ = checkpoint.load_model(path)
      results = tasks.score_all(model, params, study.tasks)
      exact = {f"{task}_exact_match": r["exact_match"] for task, r in results.items() if "exact_match" in r}
      return {**{task: r["score"] for task, r in results.items()}, **exact,
              "avg_score": tasks.average_score(results)}
    # Stages named tasks_* (before generated tasks were scored by byte accuracy) are not reused.
    out[name] = stages.run(f"task_scores_{name}", run)
  return out


def time_per_sample(models: dict, timing: TimingConfig) -> dict:
  """Seconds per sample of jitted greedy `generate` for each of {name: (model, params)}.

  After one warm-up call each, the models are timed round-robin, `timing.repeats` rounds, so
  that load from other processes falls on all of them alike; each gets the median of its calls
  divided by the batch.
  """
  rng = np.random.default_rng(0)
  vocab = min(model.config.vocab_size for model, _ in models.values())
  prompts = rng.integers(0, vocab, (timing.batch, timing.prompt), dtype=np.int32)
  lengths = np.full((timing.batch,), timing.prompt, np.int32)
  calls = {name: (lambda m=model, p=params: decode.generate(m, p, prompts, lengths, timing.new_tokens))
           for name, (model, params) in models.items()}
  times = timed_alternating(calls, timing.repeats)
  return {name: {"time_per_sample_s": statistics.median(times[name]) / timing.batch, "times_s": times[name],
                 "kv_bytes_per_token": model.config.kv_bytes_per_token,
                 "params": int(sum(x.size for x in jax.tree.leaves(params)))}
          for name, (model, params) in models.items()}


def measure_quality(study: GqaStudy, stages: Stages, workdirs: dict[str, Path]) -> dict[str, dict]:
  """Held-out quality (a stage per model) of the latest checkpoint in each of {name: workdir}."""
  data = load_dataset(study.data)
  def quality(path):
    model, params, _ = checkpoint.load_model(path)
    return evaluate(model, params, data, batch_size=study.train.batch_size, num_batches=study.train.eval_batches)
  return {name: stages.run(f"quality_{name}", lambda path=path: quality(path)) for name, path in workdirs.items()}


def measure(study: GqaStudy, stages: Stages, workdirs: dict[str, Path]) -> dict[str, dict]:
  """Held-out quality (a stage per model) and time per sample (one stage, timed together) of the
  latest checkpoint in each of {name: workdir}."""
  quality = measure_quality(study, stages, workdirs)
  timing = stages.run("timing_" + "_".join(workdirs), lambda: time_per_sample(
      {name: checkpoint.load_model(path)[:2] for name, path in workdirs.items()}, study.timing))
  return {name: {**timing[name], **quality[name]} for name in workdirs}


def plot(path: Path, series: list[report.Series], xlabel: str, ylabel: str, title: str,
         annotate: list[list[str]] | None = None, paper: bool = False, lower_is_better: bool = True) -> None:
  """Line/scatter plot of (label, xs, ys) series, better quality upwards; with paper=True, a
  second panel shows the paper's Table 1."""
  with report.figure(path, panels=2 if paper else 1, size=(11 if paper else 6, 4.2)) as axes:
    report.plot_series(axes[0], series, xlabel, ylabel, title, annotate, invert_y=lower_is_better)
    if paper:
      ref = axes[1]
      for name, seconds, score in PAPER_TABLE:
        ref.plot(seconds, score, "s")
        ref.annotate(name, (seconds, score), textcoords="offset points", xytext=(5, 5), fontsize=8)
      ref.set(xlabel="time per sample (s)", ylabel="average score", title="paper, Table 1 (T5, TPUv4)")
      ref.grid(alpha=0.3)
