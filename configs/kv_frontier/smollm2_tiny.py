"""The real-model KV frontier end to end at test size: the first 2 layers of SmolLM2-135M-Instruct,
one variant of each family (full, int8, a window with and without sinks, SnapKV, MQA mean at
alpha = 0, MQA pca recovered layer by layer, MLA at MQA's bytes recovered, int8 + SnapKV, MQA mean
recovered + int8), short windows and needles: every model is one of the tiny GQA table's, so
models_from may point at its workdir. The numbers only show the pipeline works.

  kvjax run configs/kv_frontier/smollm2_tiny.py --workdir runs/kv_frontier_smollm2_tiny
"""

import pathlib

from kvjax.cli.run import load_config
from kvjax.studies.kv_frontier import KVFrontierStudy
from kvjax.studies.base.variants import pretrained_variants
from kvjax.studies.parts.real_kv import Measure
from kvjax.studies.suite.axis import SuiteConfig


def get_config() -> KVFrontierStudy:
  variants = pretrained_variants(
    dtypes=("int8",), windows=(32,), presses=("snapkv",), ratios=(0.5,), methods=("mean", "pca"), mla_rope_dims=(48, 24)
  )
  keep = (
    "full cache",
    "int8",
    "window 32",
    "window 32 + 4 sinks",
    "snapkv 0.5",
    "MQA mean",
    "MQA pca",
    "MQA pca + recovery",
  )
  return KVFrontierStudy(
    source="smollm2-135m",
    source_layers=2,
    variants=tuple(
      v for v in variants if v.name in keep or v.name.startswith(("MLA 104", "int8 +", "MQA mean + recovery +"))
    ),
    # The GQA table's recovery (configs/real_gqa/smollm2_tiny.py), so that models_from may read its models.
    recovery=load_config(pathlib.Path(__file__).parents[1] / "real_gqa" / "smollm2_tiny.py").recovery,
    measure=Measure(
      contexts=(128,),
      windows=1,
      # The cheapest suite: one task, one length (the shortest its chat template fits), 2 samples.
      suite=SuiteConfig(tasks=("niah_single_1",), lengths=(160,), samples=2, batch_size=2),
      batch=2,
      context=128,
      repeats=1,
    ),
  )
