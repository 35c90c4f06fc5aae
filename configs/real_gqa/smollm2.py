"""The GQA table on SmolLM2-135M-Instruct (kvjax.studies.real_gqa): the model as shipped (GQA-3),
MQA mean-pooled at alpha = 0 and after layer-local recovery, MQA by pca after the same recovery,
MLA at MQA's bytes (latent 104 + 24 rotary dims) recovered; time per sample at batch 8 of 2,048 +
256 tokens. Layer-local recovery: 60 steps per layer on 128 windows of 256 tokens of stdlib source.

  kvjax run configs/real_gqa/smollm2.py --workdir runs/real_gqa
"""

from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.studies.passkey import PasskeyConfig
from kvjax.studies.real_gqa import RealGqaStudy
from kvjax.studies.real_kv import Measure, Recovery
from kvjax.studies.stages import TimingConfig


def get_config() -> RealGqaStudy:
  return RealGqaStudy(
    source="smollm2-135m",
    best=KVHeads(1, "pca"),
    mla=ToMLA(104, 24),
    recovery=Recovery(
      mode="local",
      steps=60,
      batch_size=8,
      lr=1e-3,
      seq_len=256,
      windows=128,
      distill_steps=50,
      distill_lr=1e-4,
      distill_eval_every=10,
    ),
    measure=Measure(
      contexts=(1024, 2048),
      windows=1,
      recall=PasskeyConfig(distances=(64, 256, 1024), needles=4, batch_size=4),
      weights="int8",
    ),
    timing=TimingConfig(batch=8, prompt=2048, new_tokens=256, repeats=1),
  )
