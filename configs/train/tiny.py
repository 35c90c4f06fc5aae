"""A 2-layer byte-level MHA model on 1 MB of the standard library: small enough to train on two
CPU cores and watch the loss fall (and a source for `kvjax uptrain`).

  kvjax run configs/train/tiny.py
"""

from kvjax.config import ModelConfig
from kvjax.training.config import DataConfig, TrainConfig, TrainRun


def get_config() -> TrainRun:
  return TrainRun(
    model=ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, mlp_dim=192, max_len=128),
    data=DataConfig(source="stdlib", max_bytes=1_000_000, seq_len=64),
    train=TrainConfig(
      steps=300,
      batch_size=16,
      lr=3e-3,
      warmup_steps=30,
      log_every=20,
      eval_every=100,
      eval_batches=4,
      checkpoint_every=100,
      keep_checkpoints=2,
    ),
  )
