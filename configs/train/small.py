"""A ~10M-parameter byte-level MHA model (6 layers, d_model 384, 6 heads) on 8 MB of the standard
library, computing in bfloat16. Sized for an accelerator; on a CPU measure throughput with e.g.
`--set train.steps=16 train.batch_size=8 train.bf16=False`.

  kvjax run configs/train/small.py
"""

from kvjax.config import ModelConfig
from kvjax.training.config import DataConfig, TrainConfig, TrainRun


def get_config() -> TrainRun:
  return TrainRun(
    model=ModelConfig(
      vocab_size=256, d_model=384, num_layers=6, num_heads=6, num_kv_heads=6, mlp_dim=1024, max_len=512
    ),
    data=DataConfig(source="stdlib", max_bytes=8_000_000, seq_len=256),
    train=TrainConfig(
      steps=5000,
      batch_size=32,
      lr=1e-3,
      warmup_steps=200,
      bf16=True,
      log_every=50,
      eval_every=500,
      eval_batches=16,
      checkpoint_every=1000,
    ),
  )
