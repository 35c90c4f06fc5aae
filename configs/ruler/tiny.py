"""The RULER-style suite shrunk to run in seconds (the study's test and CI): SmolLM2, two tasks at
512 tokens, two samples each, the full cache (kvjax.studies.ruler).

  kvjax run configs/ruler/tiny.py --workdir runs/ruler_tiny
"""

from kvjax.studies.ruler import RulerStudy


def get_config() -> RulerStudy:
  return RulerStudy(source="smollm2-135m", lengths=(512,), tasks=("niah_single_1", "vt"), samples=2, batch_size=2)
