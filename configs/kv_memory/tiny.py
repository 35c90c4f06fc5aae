"""The KV-memory study shrunk for a CPU: the test suite runs it end to end.

kvjax run configs/kv_memory/tiny.py --workdir /tmp/kv_memory_tiny
"""

from kvjax.config import ModelConfig
from kvjax.studies.kv_memory import KVMemoryStudy, WorkloadConfig


def get_config() -> KVMemoryStudy:
  return KVMemoryStudy(
    model=ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=32),
    workload=WorkloadConfig(
      num_requests=24, prompt_median=6, prompt_sigma=0.8, output_median=8, output_sigma=0.8, seed=0
    ),
    budget_tokens=128,
    page_sizes=(8, 16, 32),
    baseline_page_size=16,
    num_slots=16,
  )
