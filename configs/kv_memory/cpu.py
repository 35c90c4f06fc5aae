"""The KV-memory study at the scale of the targets, sized for two CPU cores: 128
long-tailed requests (median prompt 128, median output 192 tokens, contexts up to 1024) within
a KV budget of 16384 token slots, i.e. 16 requests preallocated at max_len.

  kvjax run configs/kv_memory/cpu.py --workdir runs/kv_memory
"""

from kvjax.config import ModelConfig
from kvjax.studies.kv_memory import KVMemoryStudy, WorkloadConfig


def get_config() -> KVMemoryStudy:
  return KVMemoryStudy(
    model=ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128, max_len=1024),
    workload=WorkloadConfig(
      num_requests=128, prompt_median=128, prompt_sigma=0.9, output_median=192, output_sigma=0.9, seed=0
    ),
    budget_tokens=16384,
    page_sizes=(8, 16, 32),
    baseline_page_size=16,
    num_slots=96,
  )
