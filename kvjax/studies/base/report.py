"""The one writer of study results: a table as STEM.csv, STEM.json and a markdown table, and a
figure as a PNG.

A column is (key, header, format spec): the row field, its markdown heading, and the spec of
its markdown cells ("" for plain str; ".1%" writes 0.963 as 96.3%). Figures are drawn on a
`matplotlib.figure.Figure`, not through pyplot, so that neither importing nor calling this
module switches matplotlib's global backend under the caller.
"""

from __future__ import annotations

import contextlib
import csv
import json
from pathlib import Path
from typing import Iterator, Sequence

Column = tuple[str, str, str]
# (label, xs, ys): one line (or, with a single point, one marker) of a figure.
Series = tuple[str, Sequence[float], Sequence[float]]


def columns_of(row: dict, float_spec: str = ".4f") -> list[Column]:
  """Every field of `row` as a column headed by its key; floats written with `float_spec`."""
  return [(key, key, float_spec if isinstance(value, float) else "") for key, value in row.items()]


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
  """A markdown table of `columns`; a missing or None field is an empty cell."""
  lines = ["| " + " | ".join(header for _, header, _ in columns) + " |", "|" + "---|" * len(columns)]
  for row in rows:
    cells = ["" if row.get(key) is None else format(row[key], spec) for key, _, spec in columns]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_table(rows: Sequence[dict], stem: str | Path, columns: Sequence[Column]) -> str:
  """Writes STEM.csv (the columns' fields, in order) and STEM.json (every field of every row);
  returns the markdown table of the columns."""
  with open(f"{stem}.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=[key for key, _, _ in columns], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  Path(f"{stem}.json").write_text(json.dumps(list(rows), indent=2) + "\n")
  return markdown_table(rows, columns)


@contextlib.contextmanager
def figure(path: str | Path, panels: int = 1, size: tuple[float, float] = (6, 4.2), dpi: int = 120) -> Iterator[list]:
  """The axes of a new figure of `panels` side by side, `size` inches; on leaving the block the
  figure is laid out and written to `path` (PNG)."""
  from matplotlib.figure import Figure  # matplotlib is imported only by the studies that plot

  fig = Figure(figsize=size)
  axes = list(fig.subplots(1, panels, squeeze=False)[0])
  yield axes
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)


def plot_series(
  ax,
  series: Sequence[Series],
  xlabel: str,
  ylabel: str,
  title: str,
  annotate: Sequence[Sequence[str]] | None = None,
  invert_y: bool = False,
  colours: dict[str, str] | None = None,
) -> None:
  """Draws each (label, xs, ys) on `ax`, points labelled by `annotate[i]` (one text per point of
  series i); invert_y puts small values at the top (a loss, drawn so that better is up); colours:
  {label: colour}, the same across panels (otherwise matplotlib's cycle)."""
  for i, (label, xs, ys) in enumerate(series):
    ax.plot(xs, ys, "o-" if len(xs) > 1 else "o", label=label, color=(colours or {}).get(label))
    for x, y, text in zip(xs, ys, annotate[i] if annotate else ()):
      ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
  ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
  if invert_y:
    ax.invert_yaxis()
  ax.grid(alpha=0.3)
  if len(series) > 1:
    ax.legend(fontsize=8)


def scatter_by_family(ax, rows: Sequence[dict], x: str, y: str, colours: dict[str, str], fontsize: int = 7) -> None:
  """One marker per row at (row[x], row[y]), coloured by row["family"] (legend entries per
  family in `colours` order), each annotated with row["variant"]."""
  for family, colour in colours.items():
    points = [r for r in rows if r["family"] == family]
    if points:
      ax.plot([r[x] for r in points], [r[y] for r in points], "o", color=colour, label=family)
    for r in points:
      ax.annotate(r["variant"], (r[x], r[y]), textcoords="offset points", xytext=(4, 4), fontsize=fontsize)
