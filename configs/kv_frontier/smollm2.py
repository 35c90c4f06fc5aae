"""The KV frontier on SmolLM2-135M-Instruct (float32, CPU): every family of KV compression on the
pretrained model (kvjax.studies.base.variants.pretrained_variants), cut to what two CPU cores
measure in under an hour: the full cache; fp8 / int8 / int4 caches (bf16 is float32's to 0.1%),
int4 behind a Hadamard rotation and KIVI's 2- and 4-bit layouts;
a 256-token window on every layer without and with 4 sinks, at decode time; SnapKV at 0.75
(every press at every ratio is the eviction study's, configs/eviction);
its 3 kv heads mean-pooled and pca'd to one at alpha = 0 and pca after layer-local recovery (60
steps per layer on 128 windows of 256 tokens; mean-pooling after recovery is the GQA table's
row); MLA at the bytes of its GQA-3 cache (latent 336 + 48 rotary dims) at alpha = 0 and of MQA
(104 + 24) recovered; int8 + SnapKV 0.5 and recovered MQA + int8. Perplexity on one held-out
prose window each of 1,024 and 2,048 tokens; recall on the RULER-style suite (single needle and
multi-key, 4 samples each at 1,024 and 2,048 tokens, query-aware: the first 4 of the GQA table's
6, so rows compare sample by sample); the decode step at batch 8 over 2,048 positions. Gemma 3
270M is the MQA row as trained (a peer: its own import, the full cache; its KV bytes count the
512-token window of five of its six layers).

The suite's cost, from the full cache's pass over 88 samples on a quiet 2-core machine (about
4 minutes at 1,024 tokens, 9 at 2,048: 2.7 s and 6.1 s a sample): 2 tasks x 4 samples x (2.7 +
6.1) s = 70 s a variant, 14 variants about 16 minutes, Gemma 3 (twice the work a token, its
262,144-token head) about 2.5 more; the pass key it replaces (Measure.passkey, off here: set
measure.passkey to add its columns) took about a minute a variant. Reuse the
GQA table's models with --set models_from=runs/real_gqa; drop the `keep` filter for the whole
grid.

  kvjax run configs/kv_frontier/smollm2.py --workdir runs/kv_frontier_smollm2 --set "models_from='runs/real_gqa'"
"""

import pathlib

from kvjax.cli.run import load_config
from kvjax.studies.kv_frontier import KVFrontierStudy
from kvjax.studies.base.variants import pretrained_variants
from kvjax.studies.parts.real_kv import Measure
from kvjax.studies.suite.axis import SuiteConfig


def keep(variant) -> bool:
  if variant.family == "press":
    return variant.name == "snapkv 0.75"
  return variant.name not in ("bf16", "MQA mean + recovery")


def get_config() -> KVFrontierStudy:
  return KVFrontierStudy(
    source="smollm2-135m",
    variants=tuple(v for v in pretrained_variants(mla_recovered=(False, True)) if keep(v)),
    # The GQA table's recovery (configs/real_gqa/smollm2.py), so that models_from may read its models.
    recovery=load_config(pathlib.Path(__file__).parents[1] / "real_gqa" / "smollm2.py").recovery,
    peers=("gemma3-270m",),
    measure=Measure(
      contexts=(1024, 2048),
      windows=1,
      suite=SuiteConfig(lengths=(1024, 2048), samples=4, batch_size=4),
      batch=8,
      context=2048,
      repeats=3,
      weights="int8",
    ),
  )
