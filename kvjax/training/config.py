"""Run configs for training: DataConfig, TrainConfig and the top-level TrainRun.

The generic config machinery lives in kvjax.config and is re-exported here, so a job module
can take everything it needs from one place.
"""

from __future__ import annotations

import dataclasses
import math
import os

from kvjax.config import ModelConfig
from kvjax.fields import (
  INT32_MAX,
  SEED_MAX,
  apply_overrides,
  check_choice,
  check_nonnegative,
  check_positive,
  check_real,
  config_keys,
  from_dict,
  to_dict,
)
from kvjax.sharding import parse_mesh

__all__ = ["DataConfig", "TrainConfig", "TrainRun", "apply_overrides", "config_keys", "from_dict", "to_dict"]


HELD_OUT_RULES = ("spread", "tail")


def _nameable(path: str) -> bool:
  """Whether this system's file names can hold `path` (no NUL, encodable in its file-system encoding)."""
  if "\x00" in path:
    return False
  try:
    os.fsencode(path)
  except UnicodeEncodeError:
    return False
  return True


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """A byte-level corpus: "stdlib" (this Python's standard-library sources), a text file or a
  directory of text files. The first max_bytes bytes are used; val_fraction of them is held out
  (`kvjax.training.data.held_out_mask`): with held_out="spread", in blocks spread over the whole corpus;
  with "tail", its last bytes (for a corpus in time order). Training windows of seq_len + 1
  bytes are drawn at random from a generator seeded with `seed`.
  """

  source: str = "stdlib"
  max_bytes: int = 4_000_000
  val_fraction: float = 0.05
  held_out: str = "spread"
  seq_len: int = 128
  seed: int = 0

  def __post_init__(self):
    if not isinstance(self.source, str) or not self.source.strip() or not _nameable(self.source):
      raise ValueError(f"DataConfig.source must be 'stdlib' or a path, got {self.source!r}")
    check_positive(self, "max_bytes")
    check_positive(self, "seq_len", most=INT32_MAX)
    check_nonnegative(self, "seed", most=SEED_MAX)
    check_real(self, "val_fraction", 0.0, 0.5, open_low=True)
    check_choice(self, "held_out", HELD_OUT_RULES)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """AdamW with linear warmup to `lr` over warmup_steps, then cosine decay to lr * min_lr_ratio
  at `steps` (a run shorter than its warmup only warms up); global-norm gradient clipping;
  weight decay on matrices only. Every *_every counts optimizer steps.

  `mesh` ("data=2,model=4", see kvjax.sharding) shards the run over a device mesh: batch rows on
  `data`, heads and the MLP on `model`; None trains on one device. The batch must split over
  `data`. A run may resume on another mesh.
  """

  steps: int = 1000
  batch_size: int = 32
  lr: float = 1e-3
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.95
  bf16: bool = False  # compute in bfloat16; parameters and optimizer state stay float32
  distill: float = 0.0  # weight of KL(teacher || model) on next-token distributions; needs a teacher
  log_every: int = 10
  eval_every: int = 200
  eval_batches: int = 8
  checkpoint_every: int = 500
  keep_checkpoints: int = 3
  seed: int = 0
  mesh: str | None = None

  def __post_init__(self):
    check_positive(
      self,
      "steps",
      "batch_size",
      "log_every",
      "eval_every",
      "eval_batches",
      "checkpoint_every",
      "keep_checkpoints",
      most=INT32_MAX,
    )  # optax counts steps in int32
    check_nonnegative(self, "warmup_steps", most=INT32_MAX)
    check_nonnegative(self, "seed", most=SEED_MAX)
    check_real(self, "lr", 0.0, math.inf, open_low=True, open_high=True)
    check_real(self, "min_lr_ratio", 0.0, 1.0)
    check_real(self, "weight_decay", 0.0, math.inf, open_high=True)
    check_real(self, "clip_norm", 0.0, math.inf, open_low=True, open_high=True)
    check_real(self, "b1", 0.0, 1.0, open_high=True)
    check_real(self, "b2", 0.0, 1.0, open_high=True)
    if not isinstance(self.bf16, bool):
      raise ValueError(f"TrainConfig.bf16 must be True or False, got {self.bf16!r}")
    check_real(self, "distill", 0.0, math.inf, open_high=True)
    if self.mesh is not None:
      self._check_mesh()

  def _check_mesh(self) -> None:
    if not isinstance(self.mesh, str) or not self.mesh.strip():
      raise ValueError(f"TrainConfig.mesh must be None or 'data=D,model=M', got {self.mesh!r}")
    try:
      data = parse_mesh(self.mesh)["data"]
    except ValueError as err:
      raise ValueError(f"TrainConfig.mesh={self.mesh!r}: {err}") from None
    if self.batch_size % data:
      raise ValueError(
        f"TrainConfig.batch_size={self.batch_size} does not split over the data axis "
        f"of TrainConfig.mesh={self.mesh!r} ({data}); use a multiple of {data}"
      )


@dataclasses.dataclass(frozen=True)
class TrainRun:
  """A training job: what `kvjax run` executes for a config whose job is "train"."""

  job: str = "train"
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

  def __post_init__(self):
    if not isinstance(self.job, str) or not self.job.isidentifier():
      raise ValueError(f"TrainRun.job must be a job name, got {self.job!r}")
    for name, cls in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"TrainRun.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
    if self.model.vocab_size < 256:
      raise ValueError(
        f"ModelConfig.vocab_size={self.model.vocab_size} is too small for the byte tokenizer, which needs 256"
      )
    if self.data.seq_len > self.model.max_len:
      raise ValueError(f"DataConfig.seq_len={self.data.seq_len} exceeds ModelConfig.max_len={self.model.max_len}")
