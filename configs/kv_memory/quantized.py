"""The KV-memory study with quantized caches: at one KV budget in bytes, how many requests the
engine holds with float32, int8 and int4 caches. The model has the shape of the cpu GQA table's
MHA-big (16 kv heads of head dim 32; random weights, since only memory is measured): an int8
token takes (32 + 4) / 128 of a float32 one, an int4 token (16 + 4) / 128 (kvjax.cache.quant).

  kvjax run configs/kv_memory/quantized.py --workdir runs/kv_memory_quantized
"""

from pathlib import Path

from kvjax.config import ModelConfig
from kvjax.studies.kv_memory import KVMemoryStudy, WorkloadConfig

DRIVER = Path(__file__).parents[2] / "experiments" / "kv_memory.py"


def get_config() -> KVMemoryStudy:
  return KVMemoryStudy(
      model=ModelConfig(vocab_size=256, d_model=128, num_layers=4, num_heads=16, num_kv_heads=16,
                        head_dim=32, mlp_dim=384, max_len=512),
      workload=WorkloadConfig(num_requests=160, prompt_median=64, prompt_sigma=0.9,
                              output_median=96, output_sigma=0.9, seed=0),
      budget_tokens=2048, page_sizes=(16,), baseline_page_size=16, num_slots=192,
      cache_dtypes=("int8", "int4"),
  )
