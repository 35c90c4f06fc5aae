"""The real-model GQA table end to end at test size: the first 2 layers of SmolLM2-135M-Instruct,
every row (as shipped, MQA mean at alpha = 0 and recovered, MQA pca recovered, MLA at MQA's bytes
recovered, and each recovered row distilled end to end from its recovery for 2 steps), short
windows, needles and timing. The numbers only show the pipeline works.

  kvjax run configs/real_gqa/smollm2_tiny.py --workdir runs/real_gqa_tiny
"""

from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.studies.suite.passkey import PasskeyConfig
from kvjax.studies.real_gqa import RealGqaStudy
from kvjax.studies.parts.real_kv import Measure, Recovery
from kvjax.studies.suite.axis import SuiteConfig
from kvjax.studies.base.stages import TimingConfig


def get_config() -> RealGqaStudy:
  return RealGqaStudy(
    source="smollm2-135m",
    source_layers=2,
    best=KVHeads(1, "pca"),
    mla=ToMLA(104, 24),
    recovery=Recovery(
      mode="local",
      steps=3,
      batch_size=2,
      seq_len=32,
      data_bytes=200_000,
      windows=32,
      distill_steps=2,
      distill_eval_every=2,
    ),
    measure=Measure(
      contexts=(128,),
      windows=1,
      # The cheapest suite (one task, one length, 2 samples) and the pass key beside it.
      suite=SuiteConfig(tasks=("niah_single_1",), lengths=(160,), samples=2, batch_size=2),
      passkey=PasskeyConfig(lengths=(128,), needles=2, batch_size=2),
    ),
    timing=TimingConfig(batch=2, prompt=64, new_tokens=4, repeats=1),
  )
