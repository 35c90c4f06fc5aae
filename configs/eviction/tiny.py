"""The eviction study shrunk to run in a minute: one press, 2 needles in prompts of 200 tokens
answered in the pass-key budget (twice "The secret passkey is 48213." in tokens), one short
perplexity window (the study's test).

  kvjax run configs/eviction/tiny.py --workdir runs/eviction_tiny
"""

from kvjax.studies.eviction import EvictionStudy


def get_config() -> EvictionStudy:
  return EvictionStudy(
    source="smollm2-135m",
    presses=("snapkv",),
    ratios=(0.75,),
    recall_ratios=(0.75,),
    trials=2,
    context=200,
    batch_size=2,
    perplexity_context=128,
    continuation=32,
    windows=1,
  )
