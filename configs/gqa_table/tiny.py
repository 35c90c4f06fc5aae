"""The GQA table at toy size: every stage runs (two pre-trainings, two uptrainings, timing,
quality, files) at a size the test suite runs. The numbers only show the pipeline works.

  kvjax run configs/gqa_table/tiny.py --workdir runs/gqa_tiny
"""

from pathlib import Path

from kvjax.config import ModelConfig
from kvjax.studies.gqa import GqaStudy, TimingConfig
from kvjax.studies.tasks import TaskConfig
from kvjax.training.config import DataConfig, TrainConfig

DRIVER = Path(__file__).parents[2] / "experiments" / "gqa_table.py"


def get_config() -> GqaStudy:
  return GqaStudy(
      job="gqa_table",
      small=ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4,
                        mlp_dim=96, max_len=128),
      big=ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=16, num_kv_heads=16,
                      mlp_dim=192, max_len=128),
      data=DataConfig(source="stdlib", max_bytes=300_000, seq_len=64),
      train=TrainConfig(steps=60, batch_size=8, lr=3e-3, warmup_steps=10, log_every=20,
                        eval_every=60, eval_batches=2, checkpoint_every=60, keep_checkpoints=1),
      timing=TimingConfig(batch=8, prompt=8, new_tokens=24, repeats=5),
      fraction=0.1,
      mla_rows=((8, 32),),
      tasks=TaskConfig(steps=3, batch_size=4, eval_examples=4, seq_len=64),
  )
