"""A ~57M-parameter byte-level MHA model (8 layers, d_model 768, 12 heads) on all of the
standard library's sources, computing in bfloat16; for an accelerator.

  kvjax run configs/train/medium.py
"""

from kvjax.config import ModelConfig
from kvjax.training.config import DataConfig, TrainConfig, TrainRun


def get_config() -> TrainRun:
  return TrainRun(
    model=ModelConfig(
      vocab_size=256, d_model=768, num_layers=8, num_heads=12, num_kv_heads=12, mlp_dim=2048, max_len=1024
    ),
    data=DataConfig(source="stdlib", max_bytes=32_000_000, seq_len=512),
    train=TrainConfig(
      steps=20000,
      batch_size=64,
      lr=6e-4,
      warmup_steps=1000,
      bf16=True,
      log_every=100,
      eval_every=1000,
      eval_batches=32,
      checkpoint_every=2000,
    ),
  )
