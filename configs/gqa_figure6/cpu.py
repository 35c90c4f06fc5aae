"""Figure 6 of the GQA paper at the cpu size: the study of configs/gqa_table/cpu.py.
Run it in the table's workdir to reuse the pre-trained MHA-big:

  kvjax run configs/gqa_figure6/cpu.py --workdir runs/gqa_cpu
"""

import dataclasses
from pathlib import Path

from kvjax.cli.run import load_config


def get_config():
  table = load_config(Path(__file__).parents[1] / "gqa_table" / "cpu.py")
  return dataclasses.replace(table, job="gqa_figure6")
