"""The KV frontier at toy size: every family and every stage (pre-training, the GQA table's five
uptrainings: GQA-2 / MQA mean-pooled and by pca with distillation, MLA at the bytes of 8 kv heads;
every measurement, the files) at a size the test suite runs. The numbers only show the pipeline
works.

  kvjax run configs/kv_frontier/tiny.py --workdir runs/kv_frontier_tiny
  # or reuse a finished tiny GQA table's models, read only:
  kvjax run configs/kv_frontier/tiny.py --workdir runs/kv_frontier_tiny --set models_from=runs/gqa_tiny
"""

from pathlib import Path

from kvjax.cli.run import load_config
from kvjax.studies.kv_frontier import KVFrontierStudy
from kvjax.studies.suite.recall import RecallConfig
from kvjax.studies.base.stages import TimingConfig
from kvjax.studies.parts.toy_kv import ToyMeasure
from kvjax.studies.base.variants import toy_variants

GQA_TABLE = Path(__file__).parents[1] / "gqa_table" / "tiny.py"


def get_config() -> KVFrontierStudy:
  gqa = load_config(GQA_TABLE)
  return KVFrontierStudy(
    gqa=gqa,
    variants=toy_variants(gqa, windows=(16,), sinks=2),
    measure=ToyMeasure(
      recall=RecallConfig(distances=(24, 40), needles=4, needle_bytes=8),
      # Timed at the recall test's shapes (4 rows, prompts in the 64-byte bucket, 8 new tokens), so
      # that the timed generate is the one recall compiled.
      timing=TimingConfig(batch=4, prompt=40, new_tokens=8, repeats=3),
    ),
  )
