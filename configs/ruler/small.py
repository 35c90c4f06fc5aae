"""The RULER-style suite at 1,024 and 2,048 tokens: every task, 8 samples per task and length,
the full cache, query-agnostic (kvjax.studies.ruler). About ten minutes per model on 2 CPU cores;
another model: --set source=NAME (a named model, a GGUF file or an imported workdir).

  kvjax run configs/ruler/small.py --workdir runs/ruler_small
"""

from kvjax.studies.ruler import RulerStudy


def get_config() -> RulerStudy:
  return RulerStudy(source="smollm2-135m", lengths=(1024, 2048), samples=8, batch_size=8)
