"""The GQA table on a pretrained model: as shipped, MQA (mean-pooled, best conversion) and MLA, recovered.

The rows: the model as shipped, MQA by mean-pooling its kv heads (the paper's conversion) at
alpha = 0 and recovered, MQA by kvjax's best conversion recovered, and MLA at MQA's bytes
recovered; each a Variant (kvjax.studies.base.variants) with the full cache. With
Recovery.distill_steps, each recovered row also gets the paper's path after it: end-to-end
uptraining with distillation from the model as shipped, started from the layer-local recovery
(kvjax uptrain --init), whose held-out loss against its steps is drawn as the gap it closes
(gap_closed_vs_steps.{png,md,csv,json}; kvjax.conversion.curve).

Peers (`peers`): other pretrained models as trained, through the full cache, as rows after the
table's (Gemma 3 270M: MQA as trained, its KV bytes counting its 512-token window on five of six
layers).

Columns: KV bytes per token (kvjax.studies.base.measure); time per sample (one jitted `generate` of
timing.batch rows of timing.prompt tokens + timing.new_tokens greedy tokens, over the batch;
models timed round-robin, kvjax.studies.base.stages.time_per_sample, weights stored as
measure.weights); held-out perplexity; the RULER-style suite per length and its mean (kvjax.studies.suite.axis), and the
pass key when asked (per-sample records under "samples", and as WORKDIR/samples.jsonl and
answers.jsonl);
and the gap each row closes in loss per token at the longest context, ln perplexity: 0% at
mean-pooling at alpha = 0, 100% at the model as shipped.

Every model made and every row measured is a stage (kvjax.studies.base.stages): the same command
over the same workdir resumes after the last one finished. The timing runs whole at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Callable

from kvjax.cache.config import CacheConfig
from kvjax.conversion.conversions import KVHeads, ToMLA
from kvjax.conversion.curve import gap_closed
from kvjax.fields import to_dict
from kvjax.model.weights import store
from kvjax.studies.base import measure, report
from kvjax.studies.suite.passkey_run import write_records
from kvjax.studies.parts.real_kv import (
  Measure,
  Recovery,
  attention_kind,
  check_peers,
  folder,
  load,
  peer_folder,
  peer_name,
  prepare,
  prose_windows,
  read_back,
  recall_inputs,
  recall_row,
  stage_settings,
)
from kvjax.studies.base.stages import Stages, TimingConfig, time_per_sample
from kvjax.studies.base.variants import Variant

PROTOCOL = """Protocol: {source} imported from its file (float32). MQA rows convert its {kv} kv heads to
one: "mean" mean-pools them (Ainslie et al. 2023), the best conversion is {best}; MLA is
kvjax.conversion.mla at the KV bytes of MQA ({mla}). Recovery: {recovery}. Perplexity: {windows}
held-out prose windows (pydoc_data, unseen in recovery) per context, the first half prefilled
through the cache and the second half scored. Recall: the RULER-style suite (kvjax.studies.suite.axis),
tasks {tasks}, {samples} samples per task and length, {protocol}, template {template}: the share of
references found in the answer, the mean over tasks per length.{passkey}{peers} Time per sample: batch {batch}, {prompt}-token prompts + {new} greedy tokens,
weights stored as {weights}, median of {repeats} round-robin rounds over the batch. Gap closed:
(ln ppl(MQA mean, alpha 0) - ln ppl(row)) / (ln ppl(MQA mean, alpha 0) - ln ppl(as shipped)) at
{longest} tokens."""


RECOVERED = ("mean", "best", "mla")  # the recovered rows, as RealGqaStudy.distilled names them


@dataclasses.dataclass(frozen=True)
class RealGqaStudy:
  """The study `kvjax run` runs for job "real_gqa"; models_from and peers (rows of other models as
  trained, e.g. ("gemma3-270m",), MQA as trained) as KVFrontierStudy's. distilled: which recovered
  rows are then distilled end to end when recovery.distill_steps > 0 ("mean", "best", "mla")."""

  job: str = "real_gqa"
  source: str = "smollm2-135m"
  source_layers: int | None = None
  best: KVHeads = KVHeads(1, "pca")
  mla: ToMLA = ToMLA(104, 24)
  recovery: Recovery = dataclasses.field(default_factory=Recovery)
  measure: Measure = dataclasses.field(default_factory=Measure)
  timing: TimingConfig = dataclasses.field(
    default_factory=lambda: TimingConfig(batch=8, prompt=2048, new_tokens=256, repeats=2)
  )
  models_from: str = ""
  peers: tuple[str, ...] = ()
  distilled: tuple[str, ...] = RECOVERED

  def __post_init__(self):
    if self.job != "real_gqa":
      raise ValueError(f"RealGqaStudy.job must be 'real_gqa', got {self.job!r}")
    if not isinstance(self.distilled, tuple) or not set(self.distilled) <= set(RECOVERED):
      raise ValueError(
        f"RealGqaStudy.distilled must be a tuple of recovered rows among {RECOVERED}, got {self.distilled!r}"
      )
    check_peers(self.peers, "RealGqaStudy.peers")
    if not isinstance(self.best, KVHeads) or self.best.num_kv_heads != 1:
      raise ValueError(f"RealGqaStudy.best must be a KVHeads conversion to one kv head (MQA), got {self.best!r}")
    if not isinstance(self.mla, ToMLA):
      raise ValueError(f"RealGqaStudy.mla must be a ToMLA conversion, got {self.mla!r}")
    for name, cls in (("recovery", Recovery), ("measure", Measure), ("timing", TimingConfig)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"RealGqaStudy.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")

  def variants(self, num_kv_heads: int) -> list[Variant]:
    """The table's rows, named for a source of num_kv_heads kv heads."""
    mean, mode, r = KVHeads(1), self.recovery.mode, self.recovery
    recovered = {
      "mean": Variant(f"MQA mean + {mode} recovery", "heads", conversion=mean, recovered=True),
      "best": Variant(f"MQA {self.best.label} + {mode} recovery", "heads", conversion=self.best, recovered=True),
      "mla": Variant(f"MLA {self.mla.label} (MQA bytes) + {mode} recovery", "mla", conversion=self.mla, recovered=True),
    }
    distilled = [
      dataclasses.replace(v, name=f"{v.name} + distillation ({r.distill_steps} steps)", distill=r.distill)
      for key, v in recovered.items()
      if r.distill_steps and key in self.distilled
    ]
    return [
      Variant(f"as shipped (GQA-{num_kv_heads})", "full"),
      Variant("MQA mean, alpha 0", "heads", conversion=mean),
      *recovered.values(),
      *distilled,
    ]


def run(study: RealGqaStudy, workdir: Path, progress: Callable[[str], None]) -> list[dict]:
  """The table's rows, then one per peer; writes real_gqa.{csv,json,md,png} to workdir."""
  workdir = Path(workdir)
  wanted = study.variants(0)
  paths = prepare(
    study.source, study.source_layers, study.recovery, wanted, workdir, study.models_from, progress, peers=study.peers
  )
  rows, timed, windows, inputs = [], {}, None, []
  m = study.measure
  longest = max(m.contexts)
  # Each row's measurements are a stage, named by what they depend on: a rerun resumes after the
  # last row measured, and other measure settings measure again.
  done = Stages(workdir, stage_settings(study.source, study.source_layers, study.recovery), read_back, progress)
  digest = hashlib.sha256(json.dumps(to_dict(m), sort_keys=True).encode()).hexdigest()[:12]
  for i, variant in enumerate(wanted):
    model, params, tokenizer = load(paths[folder(variant, study.recovery)])
    if i == 0:
      wanted = study.variants(model.config.num_kv_heads)
      windows = {c: prose_windows(tokenizer, c, m.windows) for c in m.contexts}
      inputs = recall_inputs(tokenizer, m, model.config.max_len)
    variant = wanted[i]
    progress(f"real_gqa: measuring {variant.name}")
    measure_row = lambda: measured(model, params, tokenizer, variant.cache, m, windows, inputs, variant.name)
    rows.append(dict(done.run(f"measured {variant.name}, {variant.cache}, {digest}", measure_row)))
    rows[-1]["params"] = folder(variant, study.recovery)
    timed[variant.name] = (model, store(params, m.weights))
  for peer in study.peers:
    model, params, tokenizer = load(paths[peer_folder(peer)])
    name = f"{peer_name(peer)} ({attention_kind(model.config)} as trained)"
    progress(f"real_gqa: measuring {name}")
    own = recall_inputs(tokenizer, m, model.config.max_len, model=peer_name(peer))
    own_windows = {c: prose_windows(tokenizer, c, m.windows) for c in m.contexts}
    measure_row = lambda: measured(model, params, tokenizer, CacheConfig(), m, own_windows, own, name)
    rows.append(dict(done.run(f"measured {name}, {digest}", measure_row)))
    rows[-1]["params"] = peer_folder(peer)
    inputs += own
    timed[name] = (model, store(params, m.weights))
  progress("real_gqa: timing every model")
  times = time_per_sample(timed, study.timing)
  ln = lambda r: math.log(r[f"perplexity_{longest}"])
  start, goal = ln(rows[1]), ln(rows[0])
  for i, row in enumerate(rows):
    row["time_per_sample_s"] = times[row["model"]]["time_per_sample_s"]
    row["times_s"] = times[row["model"]]["times_s"]
    # A peer is another model, its perplexity per token of another vocabulary: no gap to close.
    row["gap_closed"] = gap_closed(ln(row), start, goal) if i < len(wanted) else None
  write(study, rows, workdir / "real_gqa")
  write_records(workdir, inputs, [r for row in rows for r in row["samples"]])
  curves = {
    v.name: json.loads((paths[folder(v, study.recovery)] / "uptrain.json").read_text())["curve"]
    for v in wanted
    if v.distill
  }
  if curves:
    write_curves(study, curves, workdir / "gap_closed_vs_steps")
  return rows


def measured(model, params, tokenizer, cache_config, m: Measure, windows: dict, inputs: list[dict], name: str) -> dict:
  """One row's measurements through caches of cache_config: KV bytes per token, perplexity per
  context, the suite (and the pass key when measured), the per-sample results under "samples"."""
  row = {
    "model": name,
    "kv_heads": model.config.num_kv_heads,
    "kv_latent_rank": model.config.kv_latent_rank,
    "kv_bytes_per_token": measure.kv_bytes_per_token(model.config, cache_config, m.context),
  }
  for c, ws in windows.items():
    row[f"perplexity_{c}"] = measure.perplexity(model, params, ws, cache_config, c // 2)
  recall, row["samples"] = recall_row(model, params, tokenizer, cache_config, m, inputs, name)
  return row | recall


def write_curves(study: RealGqaStudy, curves: dict[str, list[dict]], stem: Path) -> str:
  """STEM.{csv,json,md,png}: the gap each distilled row closed against its steps ({model: the
  curve its uptrain.json records}); returns the markdown."""
  rows = [{"model": name, **point} for name, curve in curves.items() for point in curve]
  columns = [
    ("model", "model", ""),
    ("step", "step", "d"),
    ("val_loss", "held-out loss (nats / token)", ".4f"),
    ("gap_closed", "gap closed", ".1%"),
  ]
  table = report.write_table(rows, stem, columns)
  r = study.recovery
  text = (
    f"# The gap closed against steps on {study.source}\n\n{table}\n\n"
    f"End-to-end uptraining with distillation (weight {r.distill:g}) from the model as shipped, started "
    f"from the layer-local recovery (step 0), {r.distill_steps} steps of {r.batch_size} x {r.seq_len} "
    f"tokens of stdlib source at lr {r.distill_lr:g}. Gap closed: (loss(alpha 0) - loss) / (loss(alpha 0) - "
    "loss(as shipped)), every loss on the same held-out windows of the training data (not the table's prose)."
  )
  Path(f"{stem}.md").write_text(text + "\n")
  series = [
    (name, [p["step"] for p in c], [math.nan if p["gap_closed"] is None else p["gap_closed"] for p in c])
    for name, c in curves.items()
  ]
  with report.figure(Path(f"{stem}.png"), size=(7, 4.6)) as (ax,):
    report.plot_series(ax, series, "uptraining step", "gap closed (held-out loss)", f"{study.source}: distillation")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
  return text


def write(study: RealGqaStudy, rows: list[dict], stem: Path) -> str:
  """STEM.{csv,json,md,png}; returns the markdown."""
  m, t, r = study.measure, study.timing, study.recovery
  longest = max(m.contexts)
  columns = [
    ("model", "model", ""),
    ("kv_bytes_per_token", "KV bytes / token", ",.0f"),
    ("time_per_sample_s", f"time per sample s ({t.prompt}+{t.new_tokens})", ".3f"),
    *[(f"perplexity_{c}", f"perplexity @{c}", ".3f") for c in m.contexts],
    *[(f"suite_{n}", f"suite % @{n}", ".1f") for n in m.suite.lengths],
    ("suite_mean", "suite % mean", ".1f"),
    *[(f"passkey_{n}", f"pass key % @{n}", ".0f") for n in (m.passkey.lengths if m.passkey else ())],
    ("gap_closed", f"gap closed (ln ppl @{longest})", ".1%"),
  ]
  table = report.write_table(rows, stem, columns)
  recovery = (
    f"layer-local, {r.steps} steps per layer of {r.batch_size} x {r.seq_len}-token windows of stdlib source, lr {r.lr:g}"
    + (
      f"; the rows + distillation then train end to end from it, {r.distill_steps} steps, distillation "
      f"weight {r.distill:g}, lr {r.distill_lr:g} (gap_closed_vs_steps.md)"
      if r.distill_steps
      else ""
    )
    if r.mode == "local"
    else f"end to end, {r.steps} steps of {r.batch_size} x {r.seq_len} tokens, distillation weight {r.distill:g}"
  )
  text = f"# The GQA table on {study.source}\n\n{table}\n\n" + PROTOCOL.format(
    source=study.source,
    kv=rows[0]["kv_heads"],
    best=study.best.method,
    mla=study.mla.label,
    recovery=recovery,
    windows=m.windows,
    tasks=", ".join(m.suite.tasks),
    samples=m.suite.samples,
    protocol=m.suite.protocol,
    template=m.suite.template,
    passkey=f" Pass key: the key found in the answer, {m.passkey.needles} needles at a random depth per prompt length."
    if m.passkey
    else "",
    peers=f" Peers, measured as trained through the full cache with their own tokenizers (no gap closed): "
    f"{', '.join(study.peers)}."
    if study.peers
    else "",
    batch=t.batch,
    prompt=t.prompt,
    new=t.new_tokens,
    weights=m.weights,
    repeats=t.repeats,
    longest=longest,
  )
  Path(f"{stem}.md").write_text(text + "\n")
  with report.figure(Path(f"{stem}.png"), size=(7, 4.6)) as (ax,):
    for row in rows:
      ax.plot(row["time_per_sample_s"], row[f"perplexity_{longest}"], "o")
      ax.annotate(
        row["model"],
        (row["time_per_sample_s"], row[f"perplexity_{longest}"]),
        fontsize=7,
        xytext=(3, 3),
        textcoords="offset points",
      )
    ax.set(xlabel="time per sample (s)", ylabel=f"perplexity @{longest} (log)", yscale="log")
    ax.grid(alpha=0.3)
    ax.set_title(f"{study.source}: inference time against quality")
  return text
