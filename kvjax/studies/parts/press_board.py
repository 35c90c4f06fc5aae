"""The presses table's leaderboard (kvjax.studies.press_table): the markdown board, a row per press
and a column per compression ratio, and its two figures, kvpress's (score against ratio) and score
against KV bytes per token across presses, codecs and head counts."""

from __future__ import annotations

from pathlib import Path

from kvjax.studies.base import report
from kvjax.studies.base.measure import PROTOCOLS

FULL = "full"  # the full cache's method name
HEADS = "heads:"  # the method name's prefix of a model converted to other heads, through its full cache


def board(rows: list[dict]) -> str:
  """The leaderboard as markdown, per model and length: a row per press, its suite score at each
  ratio under each protocol the rows hold (query-agnostic / query-aware), the full cache first; a
  cell the model refuses is "refused", one not answered yet "-"."""
  out = []
  for model, length in sorted({(r["model"], r["length"]) for r in rows}):
    mine = [r for r in rows if (r["model"], r["length"]) == (model, length)]
    ratios = sorted({r["ratio"] for r in mine if r["ratio"]})
    protocols = [p for p in PROTOCOLS if any(r["protocol"] == p for r in mine)]
    named = " / ".join(p.replace("_", "-") for p in protocols)
    header = "| press | " + " | ".join(f"{x:g}" for x in ratios) + " |"
    lines = [f"{model}, {length} tokens, suite score % ({named}):", "", header]
    lines.append("|---|" + "---|" * len(ratios))
    for press in dict.fromkeys(r["press"] for r in mine):
      cells = []
      for x in ratios:
        got = {r["protocol"]: r for r in mine if r["press"] == press and r["ratio"] == x}
        cells.append(" / ".join(_cell(got.get(p)) for p in protocols) if got else "")
      full = [r for r in mine if r["press"] == press and not r["ratio"]]
      if full:
        cells = [_cell(full[0])] + [""] * (len(ratios) - 1)
      lines.append(f"| {press} | " + " | ".join(cells) + " |")
    out.append("\n".join(lines))
  return "\n\n".join(out)


def _cell(row: dict | None) -> str:
  """One score of the board: "refused", "-" (not answered, or not in the rows) or the score."""
  if row is not None and row.get("refused"):
    return "refused"
  return "-" if row is None or row["score"] is None else f"{row['score']:.1f}"


def figures(rows: list[dict], workdir: Path, protocol: str = "query_agnostic") -> None:
  """press_table.png: kvpress's leaderboard figure (the suite score against the compression ratio,
  a line per press, the full cache dashed, a panel per model and length); press_table_bytes.png:
  the score against the KV bytes per token of every cell, presses, codecs and converted head
  counts (squares) together, a panel per model and length. Both for `protocol`'s cells (the full cache's answers are either's)."""
  scored = [r for r in rows if r["score"] is not None and r["protocol"] in (protocol, "either")]
  panels = sorted({(r["model"], r["length"]) for r in scored})
  if not panels:
    return
  size = (6.4 * len(panels), 4.4)
  families = sorted({r["press"].split("+")[0] for r in scored})
  cycle = [f"C{i}" for i in range(10)] + [
    "olive",
    "navy",
    "maroon",
    "teal",
    "black",
    "gold",
    "indigo",
    "lime",
    "sienna",
    "darkcyan",
  ]
  colours = {f: cycle[i % len(cycle)] for i, f in enumerate(families)}  # a press's colour in every panel
  with report.figure(workdir / "press_table.png", len(panels), size) as axes:
    for ax, (model, length) in zip(axes, panels):
      mine = [r for r in scored if (r["model"], r["length"]) == (model, length)]
      presses = sorted(
        {r["press"] for r in mine if r["press"] != FULL and "+" not in r["press"] and not r["press"].startswith(HEADS)}
      )
      series = [
        (p, [r["ratio"] for r in line], [r["score"] for r in line])
        for p in presses
        for line in [sorted((r for r in mine if r["press"] == p), key=lambda r: r["ratio"])]
      ]
      report.plot_series(ax, series, "compression ratio", "suite score %", f"{model}, {length} tokens", colours=colours)
      for r in mine:
        if r["press"] == FULL:
          ax.axhline(r["score"], color="black", linestyle="--", linewidth=1, label="full cache")
      ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
  with report.figure(workdir / "press_table_bytes.png", len(panels), size) as axes:
    for ax, (model, length) in zip(axes, panels):
      mine = [r for r in scored if (r["model"], r["length"]) == (model, length)]
      for family in sorted({r["press"].split("+")[0] for r in mine}):
        points = [r for r in mine if r["press"].split("+")[0] == family]
        xs, ys = [r["kv_bytes_per_token"] for r in points], [r["score"] for r in points]
        ax.plot(xs, ys, "s" if family.startswith(HEADS) else "o", label=family, color=colours[family])
        for r in points:
          if "+" in r["press"]:  # a codec cell, named
            ax.annotate(r["press"].split("+")[1], (r["kv_bytes_per_token"], r["score"]), fontsize=7)
      ax.set(xscale="log", xlabel="KV bytes per token", ylabel="suite score %", title=f"{model}, {length} tokens")
      ax.minorticks_off()  # under a decade, the minor ticks' labels run into each other
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
