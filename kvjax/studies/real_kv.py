"""KV-cache compression on a pretrained model: the pieces the real-model frontier and GQA table
share (kvjax.studies.real_frontier, kvjax.studies.real_gqa).

Models. The pretrained model (a name `kvjax import` knows, a GGUF file, a Hugging Face folder) is
imported once into WORKDIR/source; each conversion (kvjax.conversion.conversions) of it is run by
kvjax.conversion.uptrain into its own folder, at alpha = 0 (`{name}_alpha0`: converted, not
trained) or recovered (`{name}_{mode}`: Recovery.mode "local", layer-local recovery, or "train",
end-to-end uptraining with distillation). Every one is a stage of WORKDIR/stages.json
(kvjax.studies.stages), so a rerun skips what is done and an interrupted recovery resumes; with
`models_from`, another study's finished workdir (same source and Recovery) is only read.

Measurements, each through the cache a CacheConfig makes (any layout, codec, window or press):
  kv_bytes_per_token  the cache's bytes for one row of `context` positions whose prompt fills it
                      (kinds.cache_bytes: scales, rings, eviction slots and their bookkeeping),
                      over `context`;
  perplexity          held-out prose windows of C tokens (pydoc_data prose, which no recovery
                      trains on): the first C/2 prefilled through the cache (a press compresses
                      them, a window drops what leaves it), the last C/2 extended into it and
                      scored; the same tokens for every variant;
  recall              pass-key recall per distance (kvjax.studies.passkey; generate from the
                      whole prompt, so a press sees the question: the query-aware protocol);
  decode step         one decode step of `batch` rows holding `context` positions (random
                      payloads written through the cache, an evicted cache holding what its
                      press keeps of a `context`-token prompt), weights stored as timing_weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cache.fill import filled, filled_evicted
from kvjax.conversion.conversions import Conversion
from kvjax.conversion.import_model import import_model
from kvjax.conversion.uptrain import uptrain
from kvjax.decoding import decode
from kvjax.config import ModelConfig
from kvjax.fields import check_choice, check_positive, check_real, from_dict, to_dict
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.model.weights import check_format, store
from kvjax.studies import stages
from kvjax.studies.passkey import PasskeyConfig, passkey
from kvjax.training import checkpoint
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset

SOURCE = "source"
MODES = ("local", "train")


@dataclasses.dataclass(frozen=True)
class Recovery:
  """How a converted model recovers: mode "local" (kvjax.conversion.local: `steps` per layer on
  `windows` calibration windows) or "train" (end-to-end uptraining for `steps` steps with distillation
  weight `distill`); both on windows of seq_len tokens of the first data_bytes bytes of the standard
  library's sources, batch_size windows a step, AdamW at `lr` after warmup_steps."""

  mode: str = "local"
  steps: int = 100
  batch_size: int = 8
  lr: float = 1e-3
  warmup_steps: int = 10
  seq_len: int = 256
  distill: float = 1.0
  data_bytes: int = 1_000_000
  windows: int = 256

  def __post_init__(self):
    check_choice(self, "mode", MODES)
    check_positive(self, "steps", "batch_size", "seq_len", "data_bytes", "windows")
    check_real(self, "lr", 0.0, 1.0, open_low=True)
    check_real(self, "distill", 0.0, 1e6)

  def overrides(self, recovered: bool) -> list[str]:
    """The uptraining's --set overrides: its data and evaluation (2 batches) always; its steps
    and optimizer when it recovers."""
    data = [
      f"data.max_bytes={self.data_bytes}",
      f"data.seq_len={self.seq_len}",
      f"train.batch_size={self.batch_size}",
      "train.eval_batches=2",
    ]
    if not recovered:
      return data
    return data + [
      f"train.steps={self.steps}",
      f"train.lr={self.lr!r}",
      f"train.warmup_steps={min(self.warmup_steps, self.steps)}",
      f"train.eval_every={self.steps}",
      f"train.checkpoint_every={self.steps}",
    ]


@dataclasses.dataclass(frozen=True)
class Params:
  """Which params a row runs: the source's (conversion None) or a conversion's, recovered or at
  alpha = 0."""

  conversion: Conversion | None = None
  recovered: bool = False

  def __post_init__(self):
    if self.recovered and self.conversion is None:
      raise ValueError("Params(recovered=True) needs a conversion to recover from")

  def folder(self, recovery: Recovery) -> str:
    if self.conversion is None:
      return SOURCE
    return f"{self.conversion.name}_{recovery.mode if self.recovered else 'alpha0'}"


def stage_settings(source: str, layers: int | None, recovery: Recovery) -> dict:
  """What a workdir's stages.json records: the models depend on these alone."""
  return {"source": source, "layers": layers, "recovery": to_dict(recovery)}


def prepare(
  source: str, layers: int | None, recovery: Recovery, wanted: list[Params], workdir: Path, models_from: str = ""
) -> dict[str, Path]:
  """{folder: path} of every params source in `wanted`: imported (its first `layers` layers when
  given) and converted (and recovered) here as stages. With models_from (the workdir of a study
  with the same settings), the models it finished are only read from there, the import among
  them, and the rest are made here from its import."""
  settings = stage_settings(source, layers, recovery)
  folders = {p.folder(recovery): p for p in wanted}
  paths, base = {}, workdir / SOURCE
  if models_from:
    root = Path(models_from)
    try:
      done = json.loads((root / "stages.json").read_text())
    except (OSError, ValueError) as err:
      raise ValueError(f"models_from={root} is not a real-model study's workdir: {err}") from None
    diffs = stages.settings_diffs(done.get("study") or {}, settings)
    if diffs:
      raise ValueError(f"models_from={root} holds models made with other settings ({'; '.join(diffs)})")
    if SOURCE not in done:
      raise ValueError(
        f"models_from={root} has not imported its model yet: run that study first, or set models_from=''"
      )
    paths = {f: root / f for f in [SOURCE, *folders] if f in done}
    base = root / SOURCE
  run = stages.Stages(workdir, settings)
  if SOURCE not in paths:
    run.run(SOURCE, lambda: import_model(source, base, layers=layers))
  for folder, p in folders.items():
    if folder in paths or p.conversion is None:
      continue
    kwargs = (
      dict(fraction=1.0, recovery=recovery.mode, overrides=recovery.overrides(True))
      | ({"local_windows": recovery.windows} if recovery.mode == "local" else {})
      if p.recovered
      else dict(fraction=0.0, overrides=recovery.overrides(False))
    )
    if p.recovered and recovery.mode == "train":
      kwargs["distill"] = recovery.distill
    run.run(folder, lambda p=p, kw=kwargs, f=folder: uptrain(base, workdir / f, p.conversion, **kw))
  return {f: paths.get(f, workdir / f) for f in folders}


def stored_config(path: Path) -> ModelConfig:
  """The ModelConfig of a workdir's latest checkpoint, from its metadata (no weights read)."""
  return from_dict(ModelConfig, checkpoint.read_meta(path, checkpoint.latest_step(path))["config"]["model"])


def load(path: Path):
  """(model, params, tokenizer) of a workdir's latest checkpoint."""
  model, params, _ = checkpoint.load_model(path)
  return model, params, TextTokenizer.load(path, model.config.vocab_size)


def kv_bytes_per_token(config, cache_config: CacheConfig, context: int) -> float:
  """Bytes of a one-row cache of `context` positions whose prompt is `context` tokens, over `context`."""
  return kinds.cache_bytes(config, cache_config, 1, context, prompt=context) / context


def prose_windows(tokenizer, length: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """`count` held-out prose windows of `length` tokens -> [(inputs, targets) int32 [count, length]]."""
  data = load_dataset(DataConfig(source=PROSE, seq_len=length), tokenizer)
  return list(eval_batches(data.val, length, count, 1))


def continuation_nll(model, params, windows, cache_config: CacheConfig, context: int) -> tuple[float, int]:
  """(summed negative log-likelihood, tokens) of the tokens after `context` of each window
  ([(inputs, targets) [n, C]]), read through a cache of cache_config that holds (and pressed) the
  first `context` tokens."""
  total, count = 0.0, 0
  for inputs, targets in windows:
    n, length = inputs.shape
    _, cache = decode.prefill(
      model, params, inputs[:, :context], np.full(n, context), length, logits="last", cache_config=cache_config
    )
    logits, _ = decode.extend(model, params, cache, inputs[:, context:], np.full(n, length - context))
    nll = -jax.nn.log_softmax(logits, axis=-1)
    picked = np.take_along_axis(np.asarray(nll), targets[:, context:, None].astype(np.int64), axis=-1)
    total += float(picked.sum())
    count += picked.size
  return total, count


def perplexity(model, params, windows, cache_config: CacheConfig) -> float:
  """Perplexity of the second half of each window, its first half through the cache."""
  total, count = continuation_nll(model, params, windows, cache_config, windows[0][0].shape[1] // 2)
  return math.exp(total / count)


def recall(model, params, tokenizer, config: PasskeyConfig, cache_config: CacheConfig) -> dict[int, float]:
  """Exact-match pass-key recall (%) per distance."""
  found = passkey(model, params, tokenizer, config, cache_config=cache_config)
  return {int(d): 100.0 * r["exact_match"] for d, r in found.items()}


def decode_step_ms(model, params, cache_config: CacheConfig, batch: int, context: int, repeats: int) -> list[float]:
  """Milliseconds of `repeats` decode steps (after warm-up ones) of `batch` rows holding
  `context` positions in a cache of cache_config."""
  max_len = context + repeats + 3
  if cache_config.press is not None:
    cache = filled_evicted(model.config, cache_config, batch, context, max_len)
  else:
    cache = filled(kinds.create(model.config, cache_config, batch, max_len), model.config, context)
  tokens = np.zeros((batch,), np.int32)
  times = []
  for i in range(repeats + 2):  # two warm-up steps: the second call compiles for the cache the first returns
    start = time.perf_counter()
    logits, cache = decode.decode_step(model, params, cache, tokens)
    jax.block_until_ready(logits)
    if i > 1:
      times.append(1e3 * (time.perf_counter() - start))
  return times


@dataclasses.dataclass(frozen=True)
class Measure:
  """The shared measurement settings: perplexity on `windows` prose windows of each of `contexts`
  tokens, pass-key `recall`, the decode step at `batch` x `context` positions over `repeats`
  steps with weights stored as `weights`."""

  contexts: tuple[int, ...] = (1024, 2048)
  windows: int = 2
  recall: PasskeyConfig = dataclasses.field(
    default_factory=lambda: PasskeyConfig(distances=(64, 256, 1024, 2048), needles=8, batch_size=4)
  )
  batch: int = 8
  context: int = 2048
  repeats: int = 3
  weights: str = "int8"

  def __post_init__(self):
    check_positive(self, "windows", "batch", "context", "repeats")
    if not self.contexts or any(not isinstance(c, int) or c < 4 or c % 2 for c in self.contexts):
      raise ValueError(f"Measure.contexts must be even token counts of at least 4, got {self.contexts!r}")
    if not isinstance(self.recall, PasskeyConfig):
      raise ValueError(f"Measure.recall must be a PasskeyConfig, got {self.recall!r}")
    check_format(self.weights)


def measure_row(model, params, tokenizer, cache_config: CacheConfig, measure: Measure, windows: dict) -> dict:
  """Every measurement of one model through one cache (windows: {C: prose_windows(C)})."""
  row = {"kv_bytes_per_token": kv_bytes_per_token(model.config, cache_config, measure.context)}
  for length, ws in windows.items():
    row[f"perplexity_{length}"] = perplexity(model, params, ws, cache_config)
  for distance, value in recall(model, params, tokenizer, measure.recall, cache_config).items():
    row[f"recall_{distance}"] = value
  row["recall_mean"] = statistics.mean(row[f"recall_{d}"] for d in measure.recall.distances)
  steps = decode_step_ms(
    model, store(params, measure.weights), cache_config, measure.batch, measure.context, measure.repeats
  )
  row["decode_step_ms"] = statistics.median(steps)
  return row
