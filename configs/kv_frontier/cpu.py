"""The KV frontier on a CPU, on the GQA table's cpu MHA-big (configs/gqa_table/cpu.py: 16 heads
of 32 dims, 1,000 steps on 4 MB of the standard library): cache dtypes, the table's uptrainings
(alpha = 0.05: GQA-2 and MQA mean-pooled and by pca + distillation, MLA at the KV bytes of GQA-2,
latent 64 + 64 rotary dims, and of MQA, 32 + 32, with distillation), windows of 32 and 64 bytes
on every layer with and without 4 sink tokens, and Gemma's pattern of local (32-byte window) and
global layers alternating. KV bytes are stated at 2,048 positions; recall at 24, 48 and 96 bytes,
so that the 32-byte window sees only the first and the 64-byte one the first two. Sized for two
CPU cores.

  kvjax run configs/kv_frontier/cpu.py --workdir runs/kv_frontier_cpu
  # or reuse a finished GQA table's models, read only:
  kvjax run configs/kv_frontier/cpu.py --workdir runs/kv_frontier_cpu --set models_from=runs/gqa_cpu
"""

from pathlib import Path

from kvjax.cli.run import load_config
from kvjax.studies.kv_frontier import KVFrontierStudy
from kvjax.studies.suite.recall import RecallConfig
from kvjax.studies.base.stages import TimingConfig
from kvjax.studies.parts.toy_kv import ToyMeasure
from kvjax.studies.base.variants import Variant, cache, toy_variants

GQA_TABLE = Path(__file__).parents[1] / "gqa_table" / "cpu.py"


def get_config() -> KVFrontierStudy:
  gqa = load_config(GQA_TABLE)
  return KVFrontierStudy(
    gqa=gqa,
    variants=toy_variants(gqa, windows=(32, 64), sinks=4)
    + (Variant("local 32 / global", "window", cache(window=(32, 0))),),
    measure=ToyMeasure(
      context=2048,
      recall=RecallConfig(distances=(24, 48, 96), needles=32, needle_bytes=12),
      timing=TimingConfig(batch=16, prompt=64, new_tokens=448, repeats=3),
    ),
  )
