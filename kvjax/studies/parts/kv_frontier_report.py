"""The KV frontier study's report (kvjax.studies.kv_frontier): its table's columns (those of the
markdown table, and the CSV's every measured field), the markdown text around the table, and the
figures of quality and recall against KV bytes per token, for a toy model (kv_frontier.png) or a
pretrained one (kv_frontier_perplexity.png, kv_frontier_recall.png). Each function reads the
study's config (a kvjax.studies.kv_frontier.KVFrontierStudy, which imports this module: it is
not imported back).
"""

from __future__ import annotations

from pathlib import Path

from kvjax.studies.base import report
from kvjax.studies.base.variants import FAMILIES

STEM = "kv_frontier"


def write(study, rows: list[dict], workdir: Path) -> str:
  """WORKDIR/kv_frontier.{csv,json,md} and the figures; returns the markdown."""
  stem = Path(workdir) / STEM
  if study.toy:
    report.write_table(rows, stem, csv_columns(study))
    text = report_text(study, rows)
    plot(study, rows, Path(f"{stem}.png"))
  else:
    text = f"# The KV frontier on {study.source}\n\n{report.write_table(rows, stem, pretrained_columns(study))}\n\n{suite_note(study)}\n"
    plot_pretrained(study, rows, stem)
  Path(f"{stem}.md").write_text(text)
  return text


def columns(study) -> list[report.Column]:
  """A toy table's columns: one recall column per distance (exact match)."""
  recall = [(f"recall_{d}", f"recall @{d}", ".0%") for d in study.measure.recall.distances]
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


def csv_columns(study) -> list[report.Column]:
  """Every measured field but the raw times: the table's plus byte accuracy per distance."""
  return (
    columns(study)[:-2]
    + [
      ("kv_heads", "kv heads", "d"),
      ("cache_dtype", "cache dtype", ""),
      ("kv_latent_rank", "latent rank", "d"),
      ("rope_dims", "rotary dims", "d"),
    ]
    + [(f"recall_bytes_{d}", f"recall bytes @{d}", ".0%") for d in study.measure.recall.distances]
    + columns(study)[-2:]
  )


def report_text(study, rows: list[dict]) -> str:
  shown = [{**r, "pareto": "yes" if r["pareto"] else ""} for r in rows]
  big, m = study.gqa.big, study.measure
  t, rc = m.timing, m.recall
  front = [r["variant"] for r in sorted(rows, key=lambda r: r["kv_bytes_per_token"]) if r["pareto"]]
  return "\n".join(
    [
      "# KV frontier",
      "",
      f"MHA-big: d_model {big.d_model}, {big.num_layers} layers, {big.num_heads} heads of {big.head_dim}, "
      f"max_len {big.max_len}; {study.gqa.train.steps} pre-training steps; uptrained variants trained for "
      f"alpha = {study.gqa.fraction} of them"
      + (f" (params read from {study.models_from})" if study.models_from else "")
      + ".",
      "",
      report.markdown_table(shown, columns(study)),
      "",
      f"- KV bytes/token: the bytes of a one-row cache of {m.context} positions holding a {m.context}-token "
      f"prompt (every array the cache kind stores: scales, ring buffers, the row's length) over {m.context}.",
      f"- bits/byte: held-out bits per byte on {m.eval_batches} x {m.eval_batch_size} windows of "
      f"{study.gqa.data.seq_len} bytes (the windows `kvjax eval` scores), from one extend into an empty cache; "
      "decode bits/byte: the same windows fed one byte per decode step, every position reading the stored "
      "cache; no-cache bits/byte: the params' own model without a cache (`kvjax eval`).",
      f"- recall @D: exact copies of {rc.needles} needles of {rc.needle_bytes} random letters and digits planted "
      "D bytes back in held-out text (kvjax.studies.suite.recall), greedy through the cache.",
      f"- decode step: median of {t.repeats} jitted `generate` calls (batch {t.batch}, prompt {t.prompt}, "
      f"{t.new_tokens} new tokens) over {t.new_tokens}, every variant timed round-robin in one run.",
      f"- front: not beaten on both KV bytes/token and bits/byte by another variant: {', '.join(front)}.",
      "",
    ]
  )


FAMILY_COLOURS = {name: family.colour for name, family in FAMILIES.items()}


def plot(study, rows: list[dict], path: Path) -> None:
  """Bits per byte and recall at the longest distance against KV bytes per token (log scale),
  a marker per variant coloured by family; the Pareto front of bits per byte drawn as a line."""
  longest = max(study.measure.recall.distances)
  with report.figure(path, panels=2, size=(12, 4.6)) as (quality, recall):
    for ax, key, label in (
      (quality, "bits_per_byte", "held-out bits/byte through the cache (better: up)"),
      (recall, f"recall_{longest}", f"recall @{longest} bytes, exact (better: up)"),
    ):
      report.scatter_by_family(ax, rows, "kv_bytes_per_token", key, FAMILY_COLOURS)
      ax.set(xscale="log", xlabel=f"KV bytes per token at {study.measure.context} positions", ylabel=label)
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


def pretrained_columns(study) -> list[report.Column]:
  """A pretrained table's columns (key, header, format)."""
  m = study.measure
  return [
    ("variant", "variant", ""),
    ("family", "family", ""),
    ("kv_bytes_per_token", f"KV bytes / token @{m.context}", ",.0f"),
    *[(f"perplexity_{c}", f"perplexity @{c}", ".3f") for c in m.contexts],
    *[(f"suite_{n}", f"suite % @{n}", ".1f") for n in m.suite.lengths],
    ("suite_mean", "suite % mean", ".1f"),
    *[(f"passkey_{n}", f"pass key % @{n}", ".0f") for n in (m.passkey.lengths if m.passkey else ())],
    ("decode_step_ms", f"decode step ms (batch {m.batch})", ".1f"),
    ("pareto_perplexity", "front (ppl)", ""),
    ("pareto_recall", "front (recall)", ""),
  ]


def suite_note(study) -> str:
  """The protocol of a pretrained frontier's recall axis, and its peers."""
  c = study.measure.suite
  peers = (
    f" Peers measured as trained, through the full cache: {', '.join(study.peers)}; each with its own tokenizer's "
    "prompts and prose (its perplexity is per token of its own vocabulary)."
    if study.peers
    else ""
  )
  return (
    f"Recall: the RULER-style suite (kvjax.studies.suite.axis), tasks {', '.join(c.tasks)}, {c.samples} samples per "
    f"task and length, {c.protocol}, template {c.template}, seed {c.seed}; a length's score is the mean over "
    "its tasks of the share of references found in the answers; front (recall) is on its mean." + peers
  )


def plot_pretrained(study, rows: list[dict], stem: Path) -> list[Path]:
  """STEM_perplexity.png and STEM_recall.png: perplexity at the longest context and the suite's
  mean score against KV bytes per token (log scale), a marker per variant coloured by family (a
  peer's "... as trained" in grey), the Pareto front as a dashed line."""
  longest = max(study.measure.contexts)
  paths = []
  for key, front, label, suffix in (
    (f"perplexity_{longest}", "pareto_perplexity", f"perplexity @{longest} tokens (log; better: down)", "perplexity"),
    ("suite_mean", "pareto_recall", "RULER-style suite %, mean over context lengths (better: up)", "recall"),
  ):
    path = Path(f"{stem}_{suffix}.png")
    with report.figure(path, size=(9, 6)) as (ax,):
      colours = FAMILY_COLOURS | {r["family"]: "tab:gray" for r in rows if r["family"] not in FAMILY_COLOURS}
      report.scatter_by_family(ax, rows, "kv_bytes_per_token", key, colours, fontsize=6)
      line = sorted((r for r in rows if r[front]), key=lambda r: r["kv_bytes_per_token"])
      ax.plot([r["kv_bytes_per_token"] for r in line], [r[key] for r in line], "k--", linewidth=1, label="Pareto front")
      ax.set(xscale="log", xlabel=f"KV bytes per token at {study.measure.context} positions", ylabel=label)
      if suffix == "perplexity":
        ax.set_yscale("log")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
      ax.set_title(f"{study.source}: {suffix} against KV memory")
    paths.append(path)
  return paths
