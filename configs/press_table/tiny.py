"""The presses table shrunk to run in seconds (its test and CI): SmolLM2, one single-needle task
at 512 tokens, two samples, SnapKV at ratio 0.5 under both protocols beside the full cache
(kvjax.studies.press_table).

  kvjax run configs/press_table/tiny.py --workdir runs/press_table_tiny
"""

from kvjax.studies.press_table import PressTableStudy


def get_config() -> PressTableStudy:
  return PressTableStudy(
    sources=("smollm2-135m",),
    lengths=(512,),
    tasks=("niah_single_1",),
    samples=2,
    presses=("snapkv",),
    ratios=(0.5,),
    batch_size=2,
  )
