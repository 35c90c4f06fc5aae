"""The KV frontier study's report: its table's columns (those of the markdown table, and the CSV's
every measured field), the markdown text around the table, and the figure of quality and recall
against KV bytes per token. The rows are kvjax.studies.kv_frontier.measure's.
"""

from __future__ import annotations

from pathlib import Path

from kvjax.studies import report
from kvjax.studies.kv_frontier import KVFrontierStudy


def columns(study: KVFrontierStudy) -> list[report.Column]:
  """The table's columns: one recall column per distance (exact match)."""
  recall = [(f"recall_{d}", f"recall @{d}", ".0%") for d in study.recall.distances]
  return (
    [
      ("variant", "variant", ""),
      ("family", "family", ""),
      ("changes", "changes", ""),
      ("params", "params", ""),
      ("kv_bytes_per_token", "KV bytes/token", ",.0f"),
      ("bits_per_byte", "bits/byte", ".4f"),
      ("decode_bits_per_byte", "decode bits/byte", ".4f"),
      ("plain_bits_per_byte", "no-cache bits/byte", ".4f"),
    ]
    + recall
    + [("decode_step_ms", "decode step (ms)", ".2f"), ("pareto", "front", "")]
  )


def csv_columns(study: KVFrontierStudy) -> list[report.Column]:
  """Every measured field but the raw times: the table's plus byte accuracy per distance."""
  return (
    columns(study)[:-2]
    + [
      ("kv_heads", "kv heads", "d"),
      ("cache_dtype", "cache dtype", ""),
      ("kv_latent_rank", "latent rank", "d"),
      ("rope_dims", "rotary dims", "d"),
    ]
    + [(f"recall_bytes_{d}", f"recall bytes @{d}", ".0%") for d in study.recall.distances]
    + columns(study)[-2:]
  )


def report_text(study: KVFrontierStudy, rows: list[dict]) -> str:
  shown = [{**r, "pareto": "yes" if r["pareto"] else ""} for r in rows]
  big, t, rc = study.gqa.big, study.timing, study.recall
  front = [r["variant"] for r in sorted(rows, key=lambda r: r["kv_bytes_per_token"]) if r["pareto"]]
  return "\n".join(
    [
      "# KV frontier",
      "",
      f"MHA-big: d_model {big.d_model}, {big.num_layers} layers, {big.num_heads} heads of {big.head_dim}, "
      f"max_len {big.max_len}; {study.gqa.train.steps} pre-training steps; uptrained variants trained for "
      f"alpha = {study.gqa.fraction} of them"
      + (f" (params read from {study.gqa_workdir})" if study.gqa_workdir else "")
      + ".",
      "",
      report.markdown_table(shown, columns(study)),
      "",
      f"- KV bytes/token: the bytes of a one-row cache of {study.context} positions (every array the cache "
      f"kind stores: scales and ring buffers included) over {study.context}.",
      f"- bits/byte: held-out bits per byte on {study.eval_batches} x {study.eval_batch_size} windows of "
      f"{study.gqa.data.seq_len} bytes (the windows `kvjax eval` scores), from one extend into an empty cache; "
      "decode bits/byte: the same windows fed one byte per decode step, every position reading the stored "
      "cache; no-cache bits/byte: the params' own model without a cache (`kvjax eval`).",
      f"- recall @D: exact copies of {rc.needles} needles of {rc.needle_bytes} random letters and digits planted "
      "D bytes back in held-out text (kvjax.studies.recall), greedy through the cache.",
      f"- decode step: median of {t.repeats} jitted `generate` calls (batch {t.batch}, prompt {t.prompt}, "
      f"{t.new_tokens} new tokens) over {t.new_tokens}, every variant timed round-robin in one run.",
      f"- front: not beaten on both KV bytes/token and bits/byte by another variant: {', '.join(front)}.",
      "",
    ]
  )


FAMILY_COLOURS = {"dtype": "tab:blue", "heads": "tab:orange", "window": "tab:green", "mla": "tab:red"}


def plot(study: KVFrontierStudy, rows: list[dict], path: Path) -> None:
  """Bits per byte and recall at the longest distance against KV bytes per token (log scale),
  a marker per variant coloured by family; the Pareto front of bits per byte drawn as a line."""
  longest = max(study.recall.distances)
  with report.figure(path, panels=2, size=(12, 4.6)) as (quality, recall):
    for ax, key, label in (
      (quality, "bits_per_byte", "held-out bits/byte through the cache (better: up)"),
      (recall, f"recall_{longest}", f"recall @{longest} bytes, exact (better: up)"),
    ):
      report.scatter_by_family(ax, rows, "kv_bytes_per_token", key, FAMILY_COLOURS)
      ax.set(xscale="log", xlabel=f"KV bytes per token at {study.context} positions", ylabel=label)
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["kv_bytes_per_token"])
    quality.plot(
      [r["kv_bytes_per_token"] for r in front],
      [r["bits_per_byte"] for r in front],
      "k--",
      linewidth=1,
      label="Pareto front",
    )
    quality.invert_yaxis()
    quality.legend(fontsize=8)
    quality.set_title("quality against KV memory")
    recall.set_ylim(-0.05, 1.05)
    recall.set_title("long-range recall against KV memory")
