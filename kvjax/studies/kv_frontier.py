"""The KV frontier study: the families of KV-cache compression side by side on one trained model,
quality against KV bytes per token (experiments/kv_frontier.py writes the table and figure, from
kvjax.studies.kv_frontier_report).

From one pre-trained MHA-big (the GQA study's: pre-trained in the study's workdir, or read from a
GQA table's workdir), each variant changes what the cache keeps:
  dtype   the codec it stores (CacheConfig.dtype: float32, bfloat16, int8, int4, float8_e4m3fn),
          MHA-big's params;
  heads   fewer kv heads (GQA, MQA): MHA-big converted by a KVHeads conversion and uptrained for
          alpha = gqa.fraction of its pre-training (kvjax.studies.stages);
  window  sliding-window layers, with or without sink tokens (CacheConfig.window, sink_tokens),
          applied to MHA-big as trained, no retraining;
  mla     multi-head latent attention: MHA-big converted by a ToMLA conversion (calibrated on its
          training data) and uptrained alike.
A variant is data (`Variant`): a name, the cache it decodes through (a CacheConfig), and the
conversion (with its distillation weight) whose uptrained params it runs; standard_variants takes
them from the GQA study's uptrainings, so both studies read the same models. Every variant's
cache is checked against the model it runs before anything trains: one error names it.

Each is measured through its cache (decode.prefill / generate build it):
  kv_bytes_per_token    what a prefill into a one-row cache of `context` positions allocates
                        (scales, ring buffers and all: the cache's nbytes), over `context`;
  bits_per_byte         held-out bits per byte on the windows `kvjax eval` scores, from the
                        logits of every position of one extend from an empty cache;
  decode_bits_per_byte  the same windows fed one byte per decode step after the first, so every
                        position reads what the cache stored, as generated tokens do (from an
                        empty cache a float kind reads the new K/V as computed, so a bfloat16
                        cache's rounding shows here only);
  recall                kvjax.studies.recall at each distance (exact match and byte accuracy);
  decode_step_ms        one decode step of a batch: the median of timing.repeats jitted generate
                        calls over timing.new_tokens, every variant timed round-robin in one run.
plain_bits_per_byte is the params' own model without a cache (`kvjax eval`'s number), the
reference for what a variant's cache costs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.config import ModelConfig
from kvjax.fields import check_choice, check_positive, check_real, to_dict
from kvjax.conversion.conversions import KINDS, Conversion
from kvjax.decoding import decode
from kvjax.model.transformer import Transformer
from kvjax.studies import gqa as gs
from kvjax.studies import recall as recall_test
from kvjax.studies import stages
from kvjax.studies.recall import RecallConfig
from kvjax.studies.stages import TimingConfig
from kvjax.training import checkpoint
from kvjax.training.data import Dataset, eval_batches, load_dataset
from kvjax.training.evaluate import evaluate

FAMILIES = ("dtype", "heads", "window", "mla")
CONVERTED_FAMILIES = ("heads", "mla")  # the kinds of kvjax.conversion.conversions
MHA_BIG = "mha_big"
DTYPES = ("float32", "bfloat16", "int8", "int4", "float8_e4m3fn")
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}


def check_variant(variant, families: tuple[str, ...]) -> None:
  """What every frontier variant checks: a non-empty name, a family of `families`, a CacheConfig."""
  if not isinstance(variant.name, str) or not variant.name.strip():
    raise ValueError(f"Variant.name must be a non-empty string, got {variant.name!r}")
  check_choice(variant, "family", families)
  if not isinstance(variant.cache, CacheConfig):
    raise ValueError(f"Variant {variant.name!r}: cache must be a CacheConfig, got {variant.cache!r}")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One point of the frontier: the params it runs, MHA-big's (conversion None) or MHA-big's
  uptrained by `conversion` with distillation weight `distill`, decoded through a cache of
  `cache`. The families "heads" and "mla" are the conversions of that kind; a dtype or window
  variant may change the cache of converted params too."""

  name: str
  family: str
  cache: CacheConfig = CacheConfig()
  conversion: Conversion | None = None
  distill: float = 0.0

  def __post_init__(self):
    check_variant(self, FAMILIES)
    if self.conversion is not None and not isinstance(self.conversion, KINDS):
      raise ValueError(f"Variant {self.name!r}: conversion must be a KVHeads or ToMLA, got {self.conversion!r}")
    if self.family in CONVERTED_FAMILIES and getattr(self.conversion, "kind", None) != self.family:
      raise ValueError(
        f"Variant {self.name!r}: family {self.family!r} runs params converted by a conversion of "
        f"that kind, got conversion={getattr(self.conversion, 'name', None)}"
      )
    check_real(self, "distill", 0.0, 1e6)
    if self.distill and self.conversion is None:
      raise ValueError(f"Variant {self.name!r}: distill={self.distill} needs a conversion to uptrain")

  def describe(self) -> str:
    """The cache's choices that differ from the default, e.g. "dtype=int8, window=(32,)";
    "as trained" without any."""
    default = CacheConfig()
    return (
      ", ".join(f"{k}={v}" for k, v in to_dict(self.cache).items() if v != getattr(default, k))
      .replace("[", "(")
      .replace("]", ",)")
      or "as trained"
    )


def standard_variants(
  gqa: gs.GqaStudy, windows: tuple[int, ...] = (), sink_tokens: int = 4, dtypes: tuple[str, ...] = DTYPES
) -> tuple[Variant, ...]:
  """Every family: a cache of each of `dtypes`; every uptraining of the GQA study
  (gqa.uptrainings(): GQA and MQA mean-pooled, each of gqa.conversions with gqa.distill); each
  window in `windows` on every layer, without sinks and, when sink_tokens > 0, with them."""
  out = [Variant(SHORT_DTYPES.get(d, d), "dtype", CacheConfig(dtype=d)) for d in dtypes]
  for conversion, distill in gqa.uptrainings():
    label = gqa.model_name(conversion.target(gqa.big)).removesuffix("-big")
    tag = f"+distill{distill:g}" if distill else ""
    out.append(Variant(f"{label} {conversion.label}{tag}", conversion.kind, conversion=conversion, distill=distill))
  for window in windows:
    out.append(Variant(f"window {window}", "window", CacheConfig(window=(window,))))
    if sink_tokens:
      out.append(
        Variant(
          f"window {window} + {sink_tokens} sinks", "window", CacheConfig(window=(window,), sink_tokens=sink_tokens)
        )
      )
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class KVFrontierStudy:
  """The study run by `kvjax run` for job "kv_frontier".

  gqa: the GQA study whose MHA-big (and uptrainings) the variants run: its big, data, train and
    fraction are used. gqa_workdir: a workdir of that same study (a GQA table's) to read them
    from, read only; empty: pre-train and uptrain them here.
  context: the sequence length KV bytes per token are stated at (default gqa.big.max_len).
  eval_batch_size, eval_batches: the held-out windows (default the run's train.batch_size and
    train.eval_batches, as `kvjax eval`).
  """

  job: str = "kv_frontier"
  gqa: gs.GqaStudy = dataclasses.field(default_factory=gs.GqaStudy)
  gqa_workdir: str = ""
  variants: tuple[Variant, ...] = ()
  context: int | None = None
  recall: RecallConfig = dataclasses.field(default_factory=RecallConfig)
  timing: TimingConfig = dataclasses.field(default_factory=TimingConfig)
  eval_batch_size: int | None = None
  eval_batches: int | None = None

  def __post_init__(self):
    if self.job != "kv_frontier":
      raise ValueError(f"KVFrontierStudy.job must be 'kv_frontier', got {self.job!r}")
    for name, cls in (("gqa", gs.GqaStudy), ("recall", RecallConfig), ("timing", TimingConfig)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"KVFrontierStudy.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
    if (
      not isinstance(self.variants, tuple)
      or not self.variants
      or not all(isinstance(v, Variant) for v in self.variants)
    ):
      raise ValueError(f"KVFrontierStudy.variants must be a non-empty tuple of Variants, got {self.variants!r}")
    names = [v.name for v in self.variants]
    if len(set(names)) != len(names):
      raise ValueError(f"KVFrontierStudy.variants: names must be distinct, got {names}")
    big = self.gqa.big
    for v in self.variants:
      try:
        source_config(self, v)
      except ValueError as err:
        raise ValueError(f"Variant {v.name!r}: {v.conversion.name} does not convert MHA-big: {err}") from None
    if not isinstance(self.gqa_workdir, str):
      raise ValueError(f"KVFrontierStudy.gqa_workdir must be a path or '', got {self.gqa_workdir!r}")
    defaults = {
      "context": big.max_len,
      "eval_batch_size": self.gqa.train.batch_size,
      "eval_batches": self.gqa.train.eval_batches,
    }
    for name, value in defaults.items():
      if getattr(self, name) is None:
        object.__setattr__(self, name, value)
    check_positive(self, "context", "eval_batch_size", "eval_batches")
    if self.context > big.max_len:
      raise ValueError(f"KVFrontierStudy.context={self.context} exceeds MHA-big's max_len={big.max_len}")
    self.recall.check_model(big.max_len, big.vocab_size)


def check_cache(config: ModelConfig, variant: Variant) -> None:
  """Raises ValueError naming the variant unless its cache fits a model of `config` (its codec
  the vectors' widths, its window the model's length)."""
  try:
    variant.cache.codec(config)
    variant.cache.model(config)
  except ValueError as err:
    raise ValueError(f"variant {variant.name!r} ({variant.describe()}) cannot decode its model: {err}") from None


def source_config(study: KVFrontierStudy, variant: Variant) -> ModelConfig:
  """The shape of the params a variant runs: MHA-big, or the target of its conversion."""
  return study.gqa.big if variant.conversion is None else variant.conversion.target(study.gqa.big)


def check_variants(study: KVFrontierStudy) -> None:
  """check_cache of every variant against the model it runs (MHA-big or its uptrained shape), on
  the host before anything trains."""
  for variant in study.variants:
    check_cache(source_config(study, variant), variant)


def source(study: KVFrontierStudy, variant: Variant) -> str:
  """The folder of the params a variant runs, inside the study's (or the GQA table's) workdir."""
  if variant.conversion is None:
    return MHA_BIG
  return stages.uptrained_name(variant.conversion, study.gqa.fraction, variant.distill)


def prepare_sources(study: KVFrontierStudy, workdir: Path) -> dict[str, Path]:
  """{source folder: workdir} of every params source of the variants. With study.gqa_workdir,
  that GQA study's finished stages, only read (its recorded settings must be study.gqa's);
  otherwise pre-trained and uptrained here, each a stage of WORKDIR/stages.json
  (kvjax.studies.stages, recorded under study.gqa's settings as a GQA study's are)."""
  names = list(dict.fromkeys(source(study, v) for v in study.variants))
  if study.gqa_workdir:
    root = Path(study.gqa_workdir)
    try:
      done = json.loads((root / "stages.json").read_text())
    except (OSError, ValueError) as err:
      raise ValueError(f"KVFrontierStudy.gqa_workdir={root} is not a GQA study's workdir: {err}") from None
    diffs = stages.settings_diffs(done.get("study") or {}, gs.stage_settings(study.gqa), gs.recorded_settings)
    if diffs:
      raise ValueError(
        f"KVFrontierStudy.gqa_workdir={root} holds a GQA study with other settings than "
        f"KVFrontierStudy.gqa ({'; '.join(diffs)})"
      )
    missing = [n for n in names if ("pretrain_big" if n == MHA_BIG else n) not in done]
    if missing:
      raise ValueError(
        f"KVFrontierStudy.gqa_workdir={root} has not finished {missing}: run that study first, "
        "or set gqa_workdir='' to train them in this workdir"
      )
    return {name: root / name for name in names}
  gqa = study.gqa
  study_stages = gs.open_stages(gqa, workdir)
  stages.pretrain(study_stages, "big", gqa.pretraining("big"))
  paths = {MHA_BIG: stages.pretrained(workdir, "big")}
  for variant in study.variants:
    if variant.conversion is not None:
      paths[source(study, variant)] = stages.uptrained(
        study_stages, paths[MHA_BIG], variant.conversion, gqa.fraction, variant.distill, mesh=gqa.train.mesh
      )
  return {name: paths[name] for name in names}


# Measurements of one variant.


def kv_bytes_per_token(model: Transformer, params, context: int, cache_config: CacheConfig) -> float:
  """Bytes a one-row cache of exactly `context` positions holds after one token (the cache's
  nbytes: every array of its layers; not prefill's, whose storage is a bucket's), over `context`."""
  empty = kinds.create(model.config, cache_config, 1, context, prompt=1)
  _, cache = decode.extend(model, params, empty, np.zeros((1, 1), np.int32), np.ones((1,), np.int32), logits="last")
  return cache.nbytes / context


@jax.jit
def _nats(logits, targets):
  """logits float32 [B, T, V], targets int32 [B, T] -> summed cross entropy."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()


@functools.partial(jax.jit, static_argnames="model")
def _decode_nats(model: Transformer, params, cache, inputs, targets):
  """inputs, targets int32 [B, T] fed one column per decode step after what `cache` holds ->
  summed cross entropy of the steps' logits."""
  ones = jnp.ones((inputs.shape[0],), jnp.int32)

  def step(cache, column):
    token, target = column  # [B], [B]
    logits, cache = decode.forward(model, params, cache, token[:, None], ones, last=True)  # [B, V]
    return cache, optax.softmax_cross_entropy_with_integer_labels(logits, target).sum()

  _, nats = jax.lax.scan(step, cache, (inputs.T, targets.T))
  return nats.sum()


def cached_bits_per_byte(
  model: Transformer, params, data: Dataset, batch_size: int, num_batches: int, cache_config: CacheConfig
) -> dict:
  """Held-out bits per byte through the cache on the windows of training.evaluate.evaluate:
  "bits_per_byte" from one extend of each window into an empty cache, "decode_bits_per_byte" from
  its first byte prefilled and the rest fed one per decode step."""
  prefilled = decoded = 0.0
  for inputs, targets in eval_batches(data.val, data.seq_len, batch_size, num_batches):
    batch, seq = inputs.shape
    logits, _ = decode.prefill(
      model, params, inputs, np.full((batch,), seq, np.int32), seq, logits="all", cache_config=cache_config
    )
    prefilled += float(_nats(logits, targets))
    first, cache = decode.prefill(
      model, params, inputs[:, :1], np.ones((batch,), np.int32), seq, logits="all", cache_config=cache_config
    )
    decode.check_cache(model, cache, np.full((batch,), seq - 1, np.int32))
    decoded += float(_nats(first, targets[:, :1]))
    decoded += float(_decode_nats(decode.for_decoding(model), params, cache, inputs[:, 1:], targets[:, 1:]))
  scale = batch_size * num_batches * data.seq_len * math.log(2) * data.bytes_per_token
  return {"bits_per_byte": prefilled / scale, "decode_bits_per_byte": decoded / scale}


def pareto(rows: list[dict], x: str, y: str, lower: bool = True) -> list[bool]:
  """Whether each row is on the Pareto front of (x, y): x lower-is-better, y lower-is-better (or
  higher with lower=False); no other row is at least as good on both and better on one."""
  sign = 1 if lower else -1

  def dominated(r):
    return any(o[x] <= r[x] and sign * o[y] <= sign * r[y] and (o[x] < r[x] or sign * o[y] < sign * r[y]) for o in rows)

  return [not dominated(r) for r in rows]


def measure(study: KVFrontierStudy, paths: dict[str, Path]) -> list[dict]:
  """One row per variant (see the module docstring), in study.variants' order; `pareto` marks the
  front of bits_per_byte against kv_bytes_per_token."""
  data = load_dataset(study.gqa.data)
  loaded = {name: checkpoint.load_model(path)[:2] for name, path in paths.items()}
  plain = {
    name: evaluate(model, params, data, batch_size=study.eval_batch_size, num_batches=study.eval_batches)[
      "bits_per_byte"
    ]
    for name, (model, params) in loaded.items()
  }
  models, rows = {}, []
  for variant in study.variants:
    base, params = loaded[source(study, variant)]
    model = models[variant.name] = base
    cache = variant.cache
    print(f"kv_frontier: measuring {variant.name}", flush=True)
    row = {
      "variant": variant.name,
      "family": variant.family,
      "params": source(study, variant),
      "changes": variant.describe(),
      "kv_heads": model.config.num_kv_heads,
      "cache_dtype": cache.codec(model.config).name,
      "kv_latent_rank": model.config.kv_latent_rank,
      "rope_dims": model.config.rope_dims,
      "kv_bytes_per_token": kv_bytes_per_token(model, params, study.context, cache),
      **cached_bits_per_byte(model, params, data, study.eval_batch_size, study.eval_batches, cache),
      "plain_bits_per_byte": plain[source(study, variant)],
    }
    for distance, result in recall_test.recall(model, params, study.recall, data.val, cache).items():
      row[f"recall_{distance}"] = result["exact_match"]
      row[f"recall_bytes_{distance}"] = result["byte_accuracy"]
    rows.append(row)
  timing = stages.time_per_sample(
    {v.name: (models[v.name], loaded[source(study, v)][1]) for v in study.variants},
    study.timing,
    {v.name: v.cache for v in study.variants},
  )
  for row, on_front in zip(rows, pareto(rows, "kv_bytes_per_token", "bits_per_byte")):
    times = timing[row["variant"]]["times_s"]
    row["decode_step_ms"] = 1e3 * statistics.median(times) / study.timing.new_tokens
    row["times_s"] = times
    row["pareto"] = on_front
  return rows
