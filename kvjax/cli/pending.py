"""Studies whose module in kvjax/studies does not define `run(study, workdir, progress)` yet: each
still runs through its script in experiments/ (`main(study, workdir)`), adapted here to what
`kvjax run` expects of a study. A job leaves SCRIPTS when its module defines run(); then this
module goes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

import kvjax

EXPERIMENTS = Path(kvjax.__file__).resolve().parents[1] / "experiments"
# job -> (its script in experiments/, a one-line description)
SCRIPTS = {
  "kv_frontier": ("kv_frontier.py", "The KV frontier: KV bytes per token against quality, on toy models."),
  "real_frontier": ("real_frontier.py", "The KV frontier on a pretrained model."),
  "real_gqa_table": ("real_gqa_table.py", "The GQA table on a pretrained checkpoint."),
  "eviction": ("eviction.py", "Recall and perplexity of a pretrained model through every eviction press."),
}


def studies() -> dict[str, str]:
  """{job: its description} of the pending studies whose script the tree holds."""
  return {job: text for job, (name, text) in SCRIPTS.items() if (EXPERIMENTS / name).is_file()}


def runner(job: str) -> Callable[[Any, Path, Callable[[str], None]], Any]:
  """run(study, workdir, progress) of a pending study: main() of its script (which prints its
  progress itself)."""
  path = EXPERIMENTS / SCRIPTS[job][0]
  spec = importlib.util.spec_from_file_location(f"kvjax_pending_{job}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return lambda study, workdir, progress: module.main(study, workdir)
