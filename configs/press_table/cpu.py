"""The presses table kvpress's users know, sized for 2 CPU cores: SmolLM2-135M-Instruct and
Gemma 3 270M on the RULER-style suite at 1,024 and 2,048 tokens (4 samples per task and length,
44 per model and length), every press (SnapKV also under AdaKV's head-adaptive budgets) at
compression ratios 0.25 / 0.5 / 0.75 / 0.875, query-agnostic and query-aware, beside the full
cache, with a few codec x press cells; Gemma 3 at 4,096 tokens for the full cache and every press
at 0.75; and SmolLM2 converted to fewer kv heads, through their full caches
(kvjax.studies.press_table). Each sample is prefilled once per protocol for all its cells, and its
records are kept as it finishes, so an interrupted table resumes; a smaller one:
--set "ratios=(0.5, 0.75)" "protocols=('query_agnostic',)".

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
    # Codecs x presses at about the bytes of a float32 press: the int8 full cache beside snapkv@0.75,
    # snapkv at 0.5 in int8 beside snapkv@0.875 in float32.
    codec_cells=(("full+int8", 0.0), ("full+bfloat16", 0.0), ("snapkv+int8", 0.5), ("snapkv+int8", 0.75)),
    long=(("gemma3-270m", 4096),),
    long_ratios=(0.75,),
    # Head counts beside the presses: SmolLM2 converted to one kv head (and to MLA at MQA's bytes)
    # by configs/real_gqa/smollm2.py, each through its full cache; refused rows until that has run.
    conversions=(
      ("smollm2-135m", "runs/real_gqa/kv1_pca_local_distill"),
      ("smollm2-135m", "runs/real_gqa/kv1_pca_local"),
      ("smollm2-135m", "runs/real_gqa/mla_r104_rope24_local"),
    ),
    batch_size=8,
  )
