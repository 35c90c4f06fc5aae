"""Studies: the jobs `kvjax run` runs (JOBS, one module each, with a config dataclass and
`run(study, workdir, progress) -> rows`) over a shared layer that no job is: the measurements
(measure, scoring, report, models, variants, stages), the long-context suite (ruler_tasks,
ruler_prompts, ruler_answers, passkey, passkey_run, suite) and the helpers of the jobs (gqa,
real_kv, toy_kv, kv_frontier_report, press_board). No job imports another (pyproject.toml's
import contract, over the same list)."""

JOBS = (
  "eviction",
  "gqa_figure4",
  "gqa_figure5",
  "gqa_figure6",
  "gqa_table",
  "kv_frontier",
  "kv_memory",
  "press_table",
  "real_gqa",
  "ruler",
)
