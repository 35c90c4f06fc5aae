"""The GQA table on a CPU: byte-level models on 4 MB of the standard library, MHA-big with 16
heads of 32 dims, GQA-2 keeping the paper's 8 query heads per kv head. Generation is timed on
long outputs (64-token prompts, 1,984 new tokens, batch 64), where reading the KV cache is
most of a decode step, as in the paper's large-batch setting. Sized for two CPU cores; its
runtime and results are in docs/results.md.

  kvjax run configs/gqa_table/cpu.py --workdir runs/gqa_cpu
"""

from kvjax.config import ModelConfig
from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.studies.parts.gqa import GqaStudy
from kvjax.studies.base.stages import TimingConfig
from kvjax.studies.base.tasks import TaskConfig
from kvjax.training.config import DataConfig, TrainConfig

BIG = ModelConfig(
  vocab_size=256, d_model=128, num_layers=4, num_heads=16, num_kv_heads=16, head_dim=32, mlp_dim=384, max_len=2048
)


def get_config() -> GqaStudy:
  return GqaStudy(
    job="gqa_table",
    small=ModelConfig(vocab_size=256, d_model=96, num_layers=4, num_heads=8, num_kv_heads=8, mlp_dim=256, max_len=2048),
    big=BIG,
    data=DataConfig(source="stdlib", max_bytes=4_000_000, seq_len=128),
    train=TrainConfig(
      steps=1000,
      batch_size=16,
      lr=2e-3,
      warmup_steps=100,
      log_every=50,
      eval_every=500,
      eval_batches=16,
      checkpoint_every=500,
      keep_checkpoints=2,
    ),
    timing=TimingConfig(batch=64, prompt=64, new_tokens=1984, repeats=5),
    # kvjax's rows: pca to GQA-2 and MQA; MLA at their KV bytes (latent 64 + 64 rotary dims, 32 + 32).
    conversions=(KVHeads(2, "pca"), KVHeads(1, "pca"), ToMLA.at_kv_heads(BIG, 2, 64), ToMLA.at_kv_heads(BIG, 1, 32)),
    fraction=0.05,
    tasks=TaskConfig(steps=60, batch_size=8, eval_examples=64),
  )
