"""The KV frontier at toy size: every family and every stage (pre-training, four uptrainings to
GQA-2 / MQA and one to MLA, every measurement, the files) at a size the test suite runs. The
numbers only show the pipeline works. MHA-big's 16 heads of 4 dims keep at least 32 rotary dims
in MLA (a pair per head), more than GQA-2's 16 values per layer and token, so the MLA row is at
the bytes of 8 kv heads: latent 32 + 32 rotary dims.

  kvjax run configs/kv_frontier/tiny.py --workdir runs/kv_frontier_tiny
"""

from pathlib import Path

from kvjax.cli.run import load_config
from kvjax.studies.gqa import TimingConfig
from kvjax.studies.kv_frontier import KVFrontierStudy, mla_variants, standard_variants
from kvjax.studies.recall import RecallConfig

DRIVER = Path(__file__).parents[2] / "experiments" / "kv_frontier.py"
GQA_TABLE = Path(__file__).parents[1] / "gqa_table" / "tiny.py"


def get_config() -> KVFrontierStudy:
  gqa = load_config(GQA_TABLE)
  return KVFrontierStudy(
      gqa=gqa,
      variants=standard_variants(gqa, windows=(16,), sink_tokens=2) + mla_variants(gqa, {8: 32}),
      recall=RecallConfig(distances=(24, 40), needles=4, needle_bytes=8),
      # Timed at the recall test's shapes (4 rows, prompts in the 64-byte bucket, 8 new tokens), so
      # that the timed generate is the one recall compiled.
      timing=TimingConfig(batch=4, prompt=40, new_tokens=8, repeats=3),
  )
