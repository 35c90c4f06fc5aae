"""Driver for job "kv_memory" (`kvjax run configs/kv_memory/<name>.py --workdir W`): serves the
study's workload under every KV allocation policy, writes kv_memory.{csv,json,md,png} to W and
returns the headline numbers."""

from __future__ import annotations

from kvjax.studies.kv_memory import KVMemoryStudy, run_study, summary


def main(config: KVMemoryStudy, workdir: str) -> dict:
  return summary(run_study(config, workdir))
