"""Studies: the jobs `kvjax run` runs (JOBS, one module each, with a config dataclass and
`run(study, workdir, progress) -> rows`) over a shared layer that no job is, in layers that
pyproject.toml's import contracts keep (every import points down; no job imports another):
  the jobs           JOBS below, the modules of this folder;
  parts/             what the jobs share that no job is: kv_frontier_report, press_board,
                     press_peer, real_kv, toy_kv, then gqa (kvjax/studies/parts/__init__.py);
  suite/             the long-context suite: the recall axis, answers and per-sample records,
                     RULER's tasks and prompts, the pass key (kvjax/studies/suite/__init__.py);
  base/              the measurement layer: measure (protocols, answers, decode steps), models,
                     report, scoring, stages, tasks, variants (kvjax/studies/base/__init__.py)."""

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
