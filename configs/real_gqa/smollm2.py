"""The GQA table on SmolLM2-135M-Instruct (kvjax.studies.real_gqa): the model as shipped (GQA-3),
MQA mean-pooled at alpha = 0 and after layer-local recovery, MQA by pca after the same recovery,
MLA at MQA's bytes (latent 104 + 24 rotary dims) recovered; time per sample at batch 8 of 2,048 +
256 tokens; Gemma 3 270M as the MQA row as trained (a peer: its own import, the full cache, its KV
bytes counting the 512-token window of five of its six layers). Recall: the RULER-style suite
(single needle and multi-key, 6 samples each at 1,024 and 2,048 tokens, query-aware): 2 x 6 x
(2.7 + 6.1) s = 106 s a row on a quiet 2-core machine (the full cache's 88-sample pass took 4
minutes at 1,024 tokens and 9 at 2,048), 8 rows about 14 minutes, Gemma 3 about 3.5 more.
Layer-local recovery: 60 steps per layer on 128 windows of 256 tokens of stdlib source.
Then each recovered row is also distilled end to end from its recovery (the paper's path, the
source as the teacher: `kvjax uptrain --init`), for about an hour on 2 CPU cores per row (three
rows, about three hours), held-out loss every 8 steps for the gap-closed curve
(gap_closed_vs_steps.png).

The hour, measured on this 2-core machine (shared, load average about 10) with `kvjax uptrain
--distill 1` of SmolLM2-135M to MQA at batch 8 x 256 tokens, 8 steps: the first step (compiling)
55 s, steps 2-8 took 502 s, 72 s a step; the first held-out eval (2 batches, compiling) about
100 s, later ones about 40 s; a checkpoint (params and AdamW state, 1.6 GB) about 27 s; loading,
converting and the three quality figures before training about 3 minutes. So per row:
  180 (setup) + 55 (first step) + 60 (eval compile) + N x 72 + N / 8 x (40 + 27) s <= 3,600 s
gives N = 40: 295 + 2,880 + 5 x 67 = 3,510 s, 58.5 minutes.

  kvjax run configs/real_gqa/smollm2.py --workdir runs/real_gqa

The MQA row alone distilled (the table's other rows still made and measured):
  kvjax run configs/real_gqa/smollm2.py --workdir runs/real_gqa --set "distilled=('best',)"
"""

from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.studies.real_gqa import RealGqaStudy
from kvjax.studies.parts.real_kv import Measure, Recovery
from kvjax.studies.suite.axis import SuiteConfig
from kvjax.studies.base.stages import TimingConfig


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
      distill_steps=40,
      distill_lr=1e-4,
      distill_eval_every=8,
    ),
    peers=("gemma3-270m",),
    measure=Measure(
      contexts=(1024, 2048),
      windows=1,
      suite=SuiteConfig(lengths=(1024, 2048), samples=6, batch_size=6),
      weights="int8",
    ),
    timing=TimingConfig(batch=8, prompt=2048, new_tokens=256, repeats=1),
  )
