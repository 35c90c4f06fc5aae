"""The KV frontier on a pretrained model: every family of KV-cache compression on one real model in
one run, quality and recall against the cache's bytes (experiments/real_frontier.py).

A variant is data (`Variant`): a name, a family, the params it runs (kvjax.studies.real_kv.Params:
the model as shipped, or a conversion of it at alpha = 0 or recovered) and the cache it decodes
through (a CacheConfig: codec, window and sinks, press and ratio, any combination). Families:
  codec     the cache's dtype (bfloat16, fp8, int8, int4) on the model as shipped;
  window    a sliding window on every layer, with or without sinks, applied at decode time to
            the model trained with full attention (StreamingLLM's setting);
  press     token eviction (kvjax.cache.presses) at a compression ratio;
  heads     fewer kv heads by a KVHeads conversion (mean, pca, regroup);
  mla       multi-head latent attention by a ToMLA conversion;
  combined  a conversion and a cache choice together (MQA + int8), or two cache choices (int8 + a
            press).
Every variant is measured alike (kvjax.studies.real_kv.measure_row); `pareto` marks the front of
perplexity at the longest context and of mean recall against KV bytes per token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvjax.cache.config import CacheConfig
from kvjax.cache.presses import PRESSES, make_press
from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.fields import to_dict
from kvjax.studies.kv_frontier import check_variant, pareto
from kvjax.studies.real_kv import Measure, Params, Recovery, load, measure_row, prepare, prose_windows, stored_config

FAMILIES = ("full", "codec", "window", "press", "heads", "mla", "combined")
SHORT_DTYPES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}


@dataclasses.dataclass(frozen=True)
class Variant:
  """One point of the frontier: `params` decoded through a cache of `cache`."""

  name: str
  family: str
  cache: CacheConfig = CacheConfig()
  params: Params = Params()

  def __post_init__(self):
    check_variant(self, FAMILIES)
    if not isinstance(self.params, Params):
      raise ValueError(f"Variant {self.name!r}: params must be a real_kv.Params, got {self.params!r}")

  def describe(self) -> str:
    """The cache's choices that differ from the default ("dtype=int8, press=snapkv, ..."), "full" without."""
    default = CacheConfig()
    changed = {k: v for k, v in to_dict(self.cache).items() if v != getattr(default, k)}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "full"


def standard_variants(
  *,
  dtypes=("bfloat16", "float8_e4m3fn", "int8", "int4"),
  windows=(256,),
  sinks: int = 4,
  presses=tuple(PRESSES),
  ratios=(0.5, 0.75, 0.875),
  methods=("mean", "pca"),
  mla_rope_dims: tuple[int, int] = (48, 24),
  mla_recovered: tuple[bool, bool] = (True, True),
  head_dim: int = 64,
  num_kv_heads: int = 3,
  combined_press: str = "snapkv",
  combined_ratio: float = 0.5,
) -> tuple[Variant, ...]:
  """The issue's frontier on a model of num_kv_heads kv heads of head_dim: the full cache; each
  codec of `dtypes`; each window without and with `sinks`; every press at every ratio; one kv
  head by each of `methods` at alpha = 0 and recovered; MLA at the bytes of the model's own kv
  heads and of one (rope dims mla_rope_dims), each recovered or at alpha = 0 (mla_recovered);
  int8 + combined_press at combined_ratio, and MQA (the last recovered method) + int8. Method
  "regroup" is left out by default: to one kv head there is one group, nothing to regroup, and it
  converts exactly as "pca"."""
  out = [Variant("full cache", "full")]
  out += [Variant(SHORT_DTYPES.get(d, d), "codec", CacheConfig(dtype=d)) for d in dtypes]
  for window in windows:
    out.append(Variant(f"window {window}", "window", CacheConfig(window=(window,), sink_tokens=0)))
    if sinks:
      out.append(
        Variant(f"window {window} + {sinks} sinks", "window", CacheConfig(window=(window,), sink_tokens=sinks))
      )
  out += [
    Variant(f"{p} {r:g}", "press", CacheConfig(press=make_press(p, compression_ratio=r)))
    for p in presses
    for r in ratios
  ]
  for method in methods:
    conversion = KVHeads(1, method)
    out.append(Variant(f"MQA {method}", "heads", params=Params(conversion)))
    out.append(Variant(f"MQA {method} + recovery", "heads", params=Params(conversion, recovered=True)))
  for heads, rope, recovered in zip((num_kv_heads, 1), mla_rope_dims, mla_recovered):
    rank = 2 * heads * head_dim - rope
    label = f"MLA {rank}+{rope} ({'GQA' if heads == num_kv_heads else 'MQA'} bytes)" + (
      " + recovery" if recovered else ""
    )
    out.append(Variant(label, "mla", params=Params(ToMLA(rank, rope), recovered)))
  out.append(
    Variant(
      f"int8 + {combined_press} {combined_ratio:g}",
      "combined",
      CacheConfig(dtype="int8", press=make_press(combined_press, compression_ratio=combined_ratio)),
    )
  )
  if methods:
    out.append(
      Variant(
        f"MQA {methods[-1]} + recovery + int8",
        "combined",
        CacheConfig(dtype="int8"),
        Params(KVHeads(1, methods[-1]), True),
      )
    )
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class RealFrontierStudy:
  """The study `kvjax run` runs for job "real_frontier". source: the pretrained model (named,
  a .gguf, a Hugging Face folder); models_from: another real-model study's workdir whose
  converted models to read (same source and recovery), '' to make them here."""

  job: str = "real_frontier"
  source: str = "smollm2-135m"
  source_layers: int | None = None
  variants: tuple[Variant, ...] = ()
  recovery: Recovery = dataclasses.field(default_factory=Recovery)
  measure: Measure = dataclasses.field(default_factory=Measure)
  models_from: str = ""

  def __post_init__(self):
    if self.job != "real_frontier":
      raise ValueError(f"RealFrontierStudy.job must be 'real_frontier', got {self.job!r}")
    if not self.variants:
      object.__setattr__(self, "variants", standard_variants())
    if not isinstance(self.variants, tuple) or not all(isinstance(v, Variant) for v in self.variants):
      raise ValueError(f"RealFrontierStudy.variants must be a tuple of Variants, got {self.variants!r}")
    names = [v.name for v in self.variants]
    if len(set(names)) != len(names):
      raise ValueError(f"RealFrontierStudy.variants: names must be distinct, got {names}")
    for name, cls in (("recovery", Recovery), ("measure", Measure)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"RealFrontierStudy.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")


def run_study(study: RealFrontierStudy, workdir: str | Path, progress=print) -> list[dict]:
  """Every variant's row (see the module docstring), in study.variants' order."""
  workdir = Path(workdir)
  paths = prepare(
    study.source, study.source_layers, study.recovery, [v.params for v in study.variants], workdir, study.models_from
  )
  for variant in study.variants:  # every cache fits its model before anything is measured
    model_config = stored_config(paths[variant.params.folder(study.recovery)])
    try:
      variant.cache.codec(model_config)
      variant.cache.model(model_config)
    except ValueError as err:
      raise ValueError(f"variant {variant.name!r} ({variant.describe()}) cannot decode its model: {err}") from None
  rows, loaded = [], {}
  windows = None
  for variant in study.variants:
    folder = variant.params.folder(study.recovery)
    if folder not in loaded:
      loaded.clear()  # one model in memory at a time
      loaded[folder] = load(paths[folder])
    model, params, tokenizer = loaded[folder]
    if windows is None:
      windows = {c: prose_windows(tokenizer, c, study.measure.windows) for c in study.measure.contexts}
    progress(f"real_frontier: measuring {variant.name}")
    row = {
      "variant": variant.name,
      "family": variant.family,
      "params": folder,
      "cache": variant.describe(),
      **measure_row(model, params, tokenizer, variant.cache, study.measure, windows),
    }
    progress(str(row))
    rows.append(row)
  longest = f"perplexity_{max(study.measure.contexts)}"
  for row, quality, recall in zip(
    rows,
    pareto(rows, "kv_bytes_per_token", longest),
    pareto(rows, "kv_bytes_per_token", "recall_mean", lower=False),
  ):
    row["pareto_perplexity"], row["pareto_recall"] = quality, recall
  return rows


def columns(study: RealFrontierStudy) -> list:
  """The table's columns (key, header, format)."""
  m = study.measure
  return [
    ("variant", "variant", ""),
    ("family", "family", ""),
    ("kv_bytes_per_token", f"KV bytes / token @{m.context}", ",.0f"),
    *[(f"perplexity_{c}", f"perplexity @{c}", ".3f") for c in m.contexts],
    *[(f"recall_{d}", f"recall % @{d}", ".0f") for d in m.recall.distances],
    ("recall_mean", "recall % mean", ".1f"),
    ("decode_step_ms", f"decode step ms (batch {m.batch})", ".1f"),
    ("pareto_perplexity", "front (ppl)", ""),
    ("pareto_recall", "front (recall)", ""),
  ]


FAMILY_COLOURS = {
  "full": "black",
  "codec": "tab:blue",
  "window": "tab:orange",
  "press": "tab:green",
  "heads": "tab:red",
  "mla": "tab:purple",
  "combined": "tab:brown",
}


def plot(study: RealFrontierStudy, rows: list[dict], stem: Path) -> list[Path]:
  """STEM_perplexity.png and STEM_recall.png: perplexity at the longest context and mean recall
  against KV bytes per token (log scale), a marker per variant coloured by family, the Pareto
  front as a dashed line."""
  from kvjax.studies import report

  longest = max(study.measure.contexts)
  paths = []
  for key, front, label, suffix in (
    (f"perplexity_{longest}", "pareto_perplexity", f"perplexity @{longest} tokens (log; better: down)", "perplexity"),
    ("recall_mean", "pareto_recall", "pass-key recall %, mean over distances (better: up)", "recall"),
  ):
    path = Path(f"{stem}_{suffix}.png")
    with report.figure(path, size=(9, 6)) as (ax,):
      report.scatter_by_family(ax, rows, "kv_bytes_per_token", key, FAMILY_COLOURS, fontsize=6)
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
