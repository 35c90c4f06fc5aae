"""Driver for job "eviction" (`kvjax run configs/eviction/<name>.py --workdir W`): recall and
perplexity of a pretrained model through every press (kvjax.studies.eviction); writes
eviction.{csv,json,md} to W and returns the rows."""

from __future__ import annotations

from kvjax.studies.eviction import EvictionStudy, run_study


def main(study: EvictionStudy, workdir: str) -> list[dict]:
  return run_study(study, workdir)
