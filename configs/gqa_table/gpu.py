"""The GQA table on one GPU (sized for an H200): bf16 training of larger
byte-level models; MHA-big has 32 heads, so GQA-4 keeps the paper's 8 query heads per kv head.

  pip install -e '.[cuda]' && kvjax run configs/gqa_table/gpu.py --workdir runs/gqa_gpu
"""

from kvjax.config import ModelConfig
from kvjax.studies.parts.gqa import GqaStudy
from kvjax.studies.base.stages import TimingConfig
from kvjax.studies.base.tasks import TaskConfig
from kvjax.training.config import DataConfig, TrainConfig


def get_config() -> GqaStudy:
  return GqaStudy(
    job="gqa_table",
    small=ModelConfig(vocab_size=256, d_model=512, num_layers=6, num_heads=8, num_kv_heads=8, max_len=2048),
    big=ModelConfig(vocab_size=256, d_model=1024, num_layers=8, num_heads=32, num_kv_heads=32, max_len=2048),
    data=DataConfig(source="stdlib", max_bytes=16_000_000, seq_len=512),
    train=TrainConfig(
      steps=1500,
      batch_size=32,
      lr=1e-3,
      warmup_steps=100,
      bf16=True,
      log_every=50,
      eval_every=500,
      eval_batches=16,
      checkpoint_every=500,
      keep_checkpoints=2,
    ),
    timing=TimingConfig(batch=128, prompt=128, new_tokens=896, repeats=5),
    fraction=0.05,
    tasks=TaskConfig(steps=100, batch_size=16, eval_examples=128),
  )
