"""The eviction study on SmolLM2-135M-Instruct (float32, CPU): every press at compression ratios
0.5 / 0.75 / 0.875 for perplexity, 24 needles in prompts of 950 tokens at ratio 0.75 for recall, under both
protocols (kvjax.studies.eviction).

  kvjax run configs/eviction/smollm2.py --workdir runs/eviction
"""

from kvjax.studies.eviction import EvictionStudy


def get_config() -> EvictionStudy:
  return EvictionStudy(source="smollm2-135m", trials=24, context=950, perplexity_context=1024, continuation=256)
