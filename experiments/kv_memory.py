"""Driver for job "kv_memory" (`kvjax run configs/kv_memory/<name>.py --workdir W`): serves the
study's workload under every KV allocation policy and writes kv_memory.{csv,md,png} to W."""

from __future__ import annotations

import json

from kvjax.memory_study import CSV_FIELDS, KVMemoryStudy, run_study


def main(config: KVMemoryStudy, workdir: str) -> list[dict]:
  rows = run_study(config, workdir)
  for row in rows:
    print(json.dumps({k: row[k] for k in CSV_FIELDS}))
  return rows
