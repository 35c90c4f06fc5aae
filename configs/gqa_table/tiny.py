"""The GQA table at toy size: every stage runs (two pre-trainings, the paper's two uptrainings and
kvjax's three: pca to GQA-2 and MQA, MLA at the bytes of 8 kv heads; timing, quality, files) at
a size the test suite runs. The numbers only show the pipeline works. MHA-big's 16 heads of 4
dims keep at least 32 rotary dims in MLA (a pair per head), more than GQA-2's 16 values per
layer and token, so the MLA row is at the bytes of 8 kv heads: latent 32 + 32 rotary dims.

  kvjax run configs/gqa_table/tiny.py --workdir runs/gqa_tiny
"""

from kvjax.config import ModelConfig
from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.studies.parts.gqa import GqaStudy
from kvjax.studies.base.stages import TimingConfig
from kvjax.studies.base.tasks import TaskConfig
from kvjax.training.config import DataConfig, TrainConfig

BIG = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=16, num_kv_heads=16, mlp_dim=192, max_len=128)


def get_config() -> GqaStudy:
  return GqaStudy(
    job="gqa_table",
    small=ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4, mlp_dim=96, max_len=128),
    big=BIG,
    data=DataConfig(source="stdlib", max_bytes=300_000, seq_len=64),
    train=TrainConfig(
      steps=60,
      batch_size=8,
      lr=3e-3,
      warmup_steps=10,
      log_every=20,
      eval_every=60,
      eval_batches=2,
      checkpoint_every=60,
      keep_checkpoints=1,
    ),
    timing=TimingConfig(batch=8, prompt=8, new_tokens=24, repeats=5),
    conversions=(KVHeads(2, "pca"), KVHeads(1, "pca"), ToMLA.at_kv_heads(BIG, 8, 32)),
    fraction=0.1,
    tasks=TaskConfig(steps=3, batch_size=4, eval_examples=4, seq_len=64),
  )
