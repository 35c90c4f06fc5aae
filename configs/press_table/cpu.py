"""The presses table kvpress's users know, sized for 2 CPU cores: SmolLM2-135M-Instruct and
Gemma 3 270M on the RULER-style suite at 1,024 and 2,048 tokens (4 samples per task and length,
88 per model and length), every press (SnapKV also under AdaKV's head-adaptive budgets) at
compression ratios 0.25 / 0.5 / 0.75 / 0.875, query-agnostic and query-aware, beside the full
cache (kvjax.studies.press_table). Each cell's answers are kept as it finishes, so an interrupted
table resumes; a smaller one: --set "ratios=(0.5, 0.75)" "protocols=('query_agnostic',)".

  kvjax run configs/press_table/cpu.py --workdir runs/press_table

kvpress on the same token ids, per sample (in an environment with kvpress; see the script):
  python experiments/kvpress_reference.py --gguf MODEL.gguf \
      --samples runs/press_table/<model>/samples.jsonl --out runs/press_table/<model>/kvpress.jsonl
then rerun the table (finished cells are read back) for the agreement column.
"""

from kvjax.studies.press_table import PressTableStudy


def get_config() -> PressTableStudy:
  return PressTableStudy(
    sources=("smollm2-135m", "gemma3-270m"),
    lengths=(1024, 2048),
    samples=4,
    ratios=(0.25, 0.5, 0.75, 0.875),
    batch_size=8,
  )
