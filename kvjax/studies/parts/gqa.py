"""The GQA paper's study (Ainslie et al. 2023): pre-train MHA models, uptrain MHA-big by a list of
conversions, and measure inference time against quality. The studies gqa_table and
gqa_figure4/5/6 (kvjax.studies) compose these pieces and the shared stages
(kvjax.studies.base.stages: pre-training, uptraining, timing), every one cached in
WORKDIR/stages.json, so a rerun skips finished stages; the table and the figures share one
GqaStudy and may share one workdir.

Naming follows the paper: MHA-small plays T5-Large, MHA-big plays T5-XXL; GQA-k and MQA rows are
named by their kv heads. Time per sample is the wall time of one jitted `generate` call divided
by the batch, with batch and lengths chosen so that reading the KV cache dominates each decode
step, as in the paper's large-batch TPU measurements.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from kvjax.cache import kinds
from kvjax.config import ModelConfig
from kvjax.fields import check_positive, check_real, from_dict, to_dict
from kvjax.conversion.conversions import KINDS, Conversion, KVHeads
from kvjax.conversion.kv_heads import METHODS
from kvjax.studies.base import report, tasks
from kvjax.studies.base import stages as shared
from kvjax.studies.base.stages import Stages, TimingConfig
from kvjax.studies.base.tasks import TaskConfig
from kvjax.training import checkpoint
from kvjax.training.config import DataConfig, TrainConfig, TrainRun
from kvjax.training.data import load_dataset
from kvjax.training.evaluate import evaluate

# Table 1 of the paper: inference time per sample (s) and average score over its tasks.
PAPER_TABLE = (
  ("MHA-Large", 0.37, 46.0),
  ("MHA-XXL", 1.51, 47.2),
  ("MQA-XXL", 0.24, 46.6),
  ("GQA-8-XXL", 0.28, 47.1),
)


# The studies a GqaStudy runs as (kvjax.studies.<job>); they share one workdir's stages.
JOBS = ("gqa_table", "gqa_figure4", "gqa_figure5", "gqa_figure6")


@dataclasses.dataclass(frozen=True)
class GqaStudy:
  """Shared by the table and the figures.

  The paper's rows are MHA-big mean-pooled to `gqa_kv_heads` kv heads (default big.num_heads //
  8, the paper's 8 query heads per kv head) and to one (MQA), uptrained for alpha = `fraction`.
  `conversions` are kvjax's rows beside them (kvjax.conversion.conversions: KVHeads by a
  data-aware method, ToMLA, ...), each uptrained alike with distillation weight `distill`; empty:
  the pca conversions to gqa_kv_heads and to one kv head. `fractions` and `methods` drive Figures
  5 and 4; `tasks` is the fine-tune protocol every row is scored by."""

  job: str = "gqa_table"
  small: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(num_heads=4, num_kv_heads=4))
  big: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(num_heads=16, num_kv_heads=16))
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  timing: TimingConfig = dataclasses.field(default_factory=TimingConfig)
  gqa_kv_heads: int = 0
  fraction: float = 0.05
  fractions: tuple[float, ...] = (0.0, 0.05, 0.1)
  methods: tuple[str, ...] = METHODS
  distill: float = 1.0
  tasks: TaskConfig = dataclasses.field(default_factory=TaskConfig)
  conversions: tuple[Conversion, ...] = ()

  def __post_init__(self):
    if self.job not in JOBS:
      raise ValueError(f"GqaStudy.job must be one of {JOBS}, got {self.job!r}")
    for name in ("small", "big"):
      cfg = getattr(self, name)
      if cfg.num_kv_heads != cfg.num_heads:
        raise ValueError(
          f"GqaStudy.{name} must be MHA (num_kv_heads == num_heads), got "
          f"{cfg.num_kv_heads} kv heads for {cfg.num_heads} heads"
        )
    if self.gqa_kv_heads == 0:
      object.__setattr__(self, "gqa_kv_heads", max(1, self.big.num_heads // 8))
    check_positive(self, "gqa_kv_heads")
    if self.big.num_heads % self.gqa_kv_heads:
      raise ValueError(f"GqaStudy.gqa_kv_heads={self.gqa_kv_heads} must divide big.num_heads={self.big.num_heads}")
    check_real(self, "fraction", 0.0, 1.0)
    if any(not 0 <= f <= 1 for f in self.fractions):
      raise ValueError(f"GqaStudy.fractions must lie in [0, 1], got {self.fractions!r}")
    if unknown := set(self.methods) - set(METHODS):
      raise ValueError(f"GqaStudy.methods has unknown methods {sorted(unknown)}; choose from {METHODS}")
    check_real(self, "distill", 0.0, 1e6)
    if not self.conversions:
      object.__setattr__(self, "conversions", (KVHeads(self.gqa_kv_heads, "pca"), KVHeads(1, "pca")))
    if not isinstance(self.conversions, tuple) or not all(isinstance(c, KINDS) for c in self.conversions):
      raise ValueError(
        f"GqaStudy.conversions must be a tuple of conversions (KVHeads, ToMLA), got {self.conversions!r}"
      )
    names = [c.name for c in self.conversions]
    if len(set(names)) != len(names):
      raise ValueError(f"GqaStudy.conversions: each conversion once, got {names}")
    for i, conversion in enumerate(self.conversions):
      try:
        conversion.target(self.big)
      except ValueError as err:
        raise ValueError(f"GqaStudy.conversions[{i}] ({conversion.name}) does not convert MHA-big: {err}") from None

  @property
  def paper_conversions(self) -> tuple[KVHeads, ...]:
    """The paper's: mean-pooling to gqa_kv_heads kv heads and to one."""
    return KVHeads(self.gqa_kv_heads), KVHeads(1)

  def uptrainings(self) -> tuple[tuple[Conversion, float], ...]:
    """(conversion, distillation weight) of every uptraining of the table: the paper's without
    distillation, then kvjax's with `distill`."""
    return tuple((c, 0.0) for c in self.paper_conversions) + tuple((c, self.distill) for c in self.conversions)

  def pretraining(self, which: str) -> TrainRun:
    """The run that pre-trains MHA-small or MHA-big (which = "small" or "big")."""
    return TrainRun(model=getattr(self, which), data=self.data, train=self.train)

  def model_name(self, config: ModelConfig) -> str:
    """MHA-big, GQA-k-big or MQA-big by config's kv heads; MLA-big for a latent model."""
    if config.is_latent:
      return "MLA-big"
    if config.num_kv_heads == self.big.num_heads:
      return "MHA-big"
    return "MQA-big" if config.num_kv_heads == 1 else f"GQA-{config.num_kv_heads}-big"

  def row_name(self, conversion: Conversion, distill: float = 0.0) -> str:
    """A table row's name: the paper's by the model alone ("GQA-2-big"), kvjax's with the way of
    converting ("GQA-2-big (pca + distill)", "MLA-big (32+32 + distill)")."""
    name = self.model_name(conversion.target(self.big))
    if conversion in self.paper_conversions and not distill:
      return name
    return f"{name} ({conversion.label}" + (" + distill)" if distill else ")")

  def kv_heads_at_bytes(self, config: ModelConfig) -> int | float:
    """The kv heads of MHA-big whose cache holds config's KV bytes per token: num_kv_heads for
    MHA / GQA / MQA, the GQA an MLA model matches in memory."""
    ratio = kinds.bytes_per_token(config) * self.big.num_kv_heads / kinds.bytes_per_token(self.big)
    return int(ratio) if ratio == int(ratio) else ratio


# Fields that only select which stages run (the table and each figure share one workdir).
STAGE_SELECTORS = ("job", "fractions", "methods", "conversions")
# Recorded by earlier GqaStudy versions: best_method became `conversions`, a stage selector.
RETIRED_FIELDS = ("best_method",)


def stage_settings(study: GqaStudy) -> dict:
  """What WORKDIR/stages.json records of a study: every field but the STAGE_SELECTORS."""
  return {k: v for k, v in to_dict(study).items() if k not in STAGE_SELECTORS}


def recorded_settings(recorded: dict) -> dict:
  """A stages.json's recorded study as this kvjax writes it: read back through GqaStudy, so that
  a field added since (window, sink_tokens, ...) takes its default and a retired one is dropped
  instead of reading as a change. A record this kvjax cannot read is returned as it is (and then
  differs)."""
  try:
    return stage_settings(from_dict(GqaStudy, {k: v for k, v in recorded.items() if k not in RETIRED_FIELDS}))
  except (ValueError, TypeError):
    return recorded


def open_stages(study: GqaStudy, workdir: Path, progress: Callable[[str], None] = print) -> Stages:
  """The study's stages in `workdir` (kvjax.studies.base.stages.Stages), recorded under its
  stage_settings: a rerun with other models, data, training or timing settings is refused.
  Each stage's progress goes to `progress`."""
  return Stages(workdir, stage_settings(study), recorded_settings, progress)


def pretrain(study: GqaStudy, stages: Stages, which: str) -> dict:
  """Pre-trains MHA-small or MHA-big in WORKDIR/mha_{which}; returns its train summary."""
  return shared.pretrain(stages, which, study.pretraining(which))


def uptrained(
  study: GqaStudy, stages: Stages, conversion: Conversion, fraction: float | None = None, distill: float = 0.0
) -> Path:
  """Uptrains MHA-big by `conversion` (alpha = study.fraction unless given) in its own workdir,
  on the study's training mesh; returns that workdir."""
  fraction = study.fraction if fraction is None else fraction
  return shared.uptrained(
    stages, shared.pretrained(stages.workdir, "big"), conversion, fraction, distill, mesh=study.train.mesh
  )


def task_scores(study: GqaStudy, stages: Stages, workdirs_by_name: dict[str, Path]) -> dict[str, dict]:
  """The paper's protocol (a stage per model): each model fine-tuned on each downstream task for
  the same study.tasks.steps and scored on that task's held-out split (kvjax.studies.base.tasks);
  {name: {task: score, ..., "avg_score": mean over tasks}}."""
  out = {}
  for name, path in workdirs_by_name.items():

    def run(path=path):
      model, params, _ = checkpoint.load_model(path)
      results = tasks.score_all(model, params, study.tasks)
      exact = {f"{task}_exact_match": r["exact_match"] for task, r in results.items() if "exact_match" in r}
      return {**{task: r["score"] for task, r in results.items()}, **exact, "avg_score": tasks.average_score(results)}

    # Stages named tasks_* (before generated tasks were scored by byte accuracy) are not reused.
    out[name] = stages.run(f"task_scores_{name}", run)
  return out


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
  timing = stages.run(
    "timing_" + "_".join(workdirs),
    lambda: shared.time_per_sample(
      {name: checkpoint.load_model(path)[:2] for name, path in workdirs.items()}, study.timing
    ),
  )
  return {name: {**timing[name], **quality[name]} for name in workdirs}


def plot(
  path: Path,
  series: list[report.Series],
  xlabel: str,
  ylabel: str,
  title: str,
  annotate: list[list[str]] | None = None,
  paper: bool = False,
  lower_is_better: bool = True,
) -> None:
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
