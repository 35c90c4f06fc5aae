"""The KV-memory study with quantized caches: at one KV budget in bytes, how many requests the
engine holds with float32, int8 and int4 caches. The heads have the cpu GQA table's MHA-big head
dim, 32, which sets the formats' sizes (kvjax.cache.quant): an int8 token takes (32 + 4) / 128 of
a float32 one, an int4 token (16 + 4) / 128. The model is otherwise small and random (only memory
is measured), and only the paged policy runs (the allocation baselines are the cpu config's).

  kvjax run configs/kv_memory/quantized.py --workdir runs/kv_memory_quantized
"""

from kvjax.config import ModelConfig
from kvjax.studies.kv_memory import KVMemoryStudy, WorkloadConfig


def get_config() -> KVMemoryStudy:
  return KVMemoryStudy(
    model=ModelConfig(
      vocab_size=256, d_model=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=128, max_len=256
    ),
    workload=WorkloadConfig(
      num_requests=200, prompt_median=32, prompt_sigma=0.9, output_median=48, output_sigma=0.9, seed=0
    ),
    budget_tokens=1024,
    page_sizes=(16,),
    baseline_page_size=16,
    num_slots=256,
    cache_dtypes=("int8", "int4"),
    baselines=False,
  )
