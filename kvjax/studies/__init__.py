"""Studies: the jobs `kvjax run` runs (JOBS, one module each, with a config dataclass and
`run(study, workdir, progress) -> rows`) over a shared layer that no job is, in layers that
pyproject.toml's import contracts keep (every import points down; no job imports another):
  the jobs           JOBS below;
  their helpers      kv_frontier_report, press_board, real_kv, toy_kv, then gqa;
  the long-context suite  suite; passkey_run, ruler_answers (answers and per-sample records);
                     ruler_tasks; ruler_prompts; passkey, recall;
  the measurements   measure (protocols, answers, decode steps), models, report, scoring, stages,
                     tasks, variants."""

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
