"""The presses table's leaderboard (kvjax.studies.press_table): the markdown board, a row per press
and a column per compression ratio, and its two figures, kvpress's (score against ratio) and score
against KV bytes per token across presses and codecs."""

from __future__ import annotations

from pathlib import Path

from kvjax.studies import report
from kvjax.studies.eviction import PROTOCOLS

FULL = "full"  # the full cache's method name


def board(rows: list[dict]) -> str:
  """The leaderboard as markdown, per model and length: a row per press, its suite score at each
  ratio (query-agnostic / query-aware), the full cache first; a refused or unanswered cell is "-"."""
  out = []
  for model, length in sorted({(r["model"], r["length"]) for r in rows}):
    mine = [r for r in rows if (r["model"], r["length"]) == (model, length)]
    ratios = sorted({r["ratio"] for r in mine if r["ratio"]})
    header = "| press | " + " | ".join(f"{x:g}" for x in ratios) + " |"
    lines = [f"{model}, {length} tokens, suite score % (query-agnostic / query-aware):", "", header]
    lines.append("|---|" + "---|" * len(ratios))
    for press in dict.fromkeys(r["press"] for r in mine):
      cells = []
      for x in ratios:
        got = {r["protocol"]: r["score"] for r in mine if r["press"] == press and r["ratio"] == x}
        cells.append(" / ".join("-" if got.get(p) is None else f"{got[p]:.1f}" for p in PROTOCOLS) if got else "")
      full = [r["score"] for r in mine if r["press"] == press and not r["ratio"]]
      if full:
        cells = [f"{full[0]:.1f}" if full[0] is not None else "-"] + [""] * (len(ratios) - 1)
      lines.append(f"| {press} | " + " | ".join(cells) + " |")
    out.append("\n".join(lines))
  return "\n\n".join(out)


def figures(rows: list[dict], workdir: Path, protocol: str = "query_agnostic") -> None:
  """press_table.png: kvpress's leaderboard figure (the suite score against the compression ratio,
  a line per press, the full cache dashed, a panel per model and length); press_table_bytes.png:
  the score against the KV bytes per token of every cell, presses and codecs together, a panel per
  model and length. Both for `protocol`'s cells (the full cache's answers are either's)."""
  scored = [r for r in rows if r["score"] is not None and r["protocol"] in (protocol, "either")]
  panels = sorted({(r["model"], r["length"]) for r in scored})
  if not panels:
    return
  size = (6.4 * len(panels), 4.4)
  with report.figure(workdir / "press_table.png", len(panels), size) as axes:
    for ax, (model, length) in zip(axes, panels):
      mine = [r for r in scored if (r["model"], r["length"]) == (model, length)]
      presses = sorted({r["press"] for r in mine if r["press"] != FULL and "+" not in r["press"]})
      series = [
        (p, [r["ratio"] for r in line], [r["score"] for r in line])
        for p in presses
        for line in [sorted((r for r in mine if r["press"] == p), key=lambda r: r["ratio"])]
      ]
      report.plot_series(ax, series, "compression ratio", "suite score %", f"{model}, {length} tokens")
      for r in mine:
        if r["press"] == FULL:
          ax.axhline(r["score"], color="black", linestyle="--", linewidth=1, label="full cache")
      ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
  with report.figure(workdir / "press_table_bytes.png", len(panels), size) as axes:
    for ax, (model, length) in zip(axes, panels):
      mine = [r for r in scored if (r["model"], r["length"]) == (model, length)]
      families = sorted({r["press"].split("+")[0] for r in mine})
      for family in families:
        points = [r for r in mine if r["press"].split("+")[0] == family]
        ax.plot([r["kv_bytes_per_token"] for r in points], [r["score"] for r in points], "o", label=family)
        for r in points:
          if "+" in r["press"]:  # a codec cell, named
            ax.annotate(r["press"].split("+")[1], (r["kv_bytes_per_token"], r["score"]), fontsize=7)
      ax.set(xscale="log", xlabel="KV bytes per token", ylabel="suite score %", title=f"{model}, {length} tokens")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
