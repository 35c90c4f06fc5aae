"""The KV-memory study: how much of a fixed KV budget holds real tokens under each allocation policy.

One seeded workload of requests (log-normal prompt and output lengths: long-tailed, like chat
traces) is served by the continuous-batching engine (kvjax.serving.engine) once per policy, all within
the same KV budget of `budget_tokens` token slots (budget_tokens x kv_bytes_per_token bytes):
  max_len   contiguous preallocation of max_len positions per request;
  doubling  a buffer per request that doubles its capacity when full;
  paged     PagedAttention at each page size in `page_sizes`.
The baselines run on pages of `baseline_page_size` tokens, which only sets their granularity
(their capacities are multiples of it), so every policy uses the same kernels and the
differences come from memory alone. Each of `cache_dtypes` (quantized formats, kvjax.cache.codec)
then serves the workload paged, at the headline page size, within the same budget in bytes:
a format of fewer bytes per token gets as many more pages. Per policy: utilisation (tokens
cached / slots allocated, summed over decode steps), peak and mean concurrent requests,
preemptions and tokens/s. Every policy should produce the same tokens for every request (greedy);
the study counts the requests that match the first policy's run (a quantized cache may differ).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.config import ModelConfig
from kvjax.fields import check_nonnegative, check_positive, check_positive_int, check_real
from kvjax.serving.engine import Engine, EngineConfig
from kvjax.model.transformer import Transformer
from kvjax.studies.base.report import figure, markdown_table, write_table
from kvjax.training.workdir import claim_study

CSV_FIELDS = (
  "policy",
  "cache_dtype",
  "page_size",
  "budget_tokens",
  "budget_bytes",
  "utilisation",
  "peak_concurrent",
  "mean_concurrent",
  "preemptions",
  "decode_steps",
  "generated_tokens",
  "seconds",
  "tokens_per_s",
  "identical_outputs",
)
# The markdown table: (row field, heading, format); peak_over_max_len is the peak concurrency
# over that of contiguous max_len preallocation.
TABLE_COLUMNS = (
  ("policy", "policy", ""),
  ("cache_dtype", "cache", ""),
  ("page_size", "page size", ""),
  ("utilisation", "utilisation", ".1%"),
  ("peak_concurrent", "peak concurrent", ""),
  ("peak_over_max_len", "x max_len", ".2f"),
  ("mean_concurrent", "mean concurrent", ".1f"),
  ("preemptions", "preemptions", ""),
  ("decode_steps", "decode steps", ""),
  ("tokens_per_s", "tokens/s", ".0f"),
)
# Section 6.2 and Figure 2 of Kwon et al., "Efficient Memory Management for Large Language Model
# Serving with PagedAttention" (SOSP 2023).
VLLM_ANCHORS = (
  ("earlier systems (Orca, FasterTransformer)", "20.4-38.2%", "1x"),
  ("vLLM", "96.3%", "2.2x the best earlier system"),
)


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
  """num_requests requests, all queued at time 0. Prompt and output lengths are log-normal with
  the given medians and log-space sigmas, clipped so that prompt + output fits max_len."""

  num_requests: int = 200
  prompt_median: int = 128
  prompt_sigma: float = 0.9
  output_median: int = 192
  output_sigma: float = 0.9
  seed: int = 0

  def __post_init__(self):
    check_positive(self, "num_requests", "prompt_median", "output_median")
    check_real(self, "prompt_sigma", 0.0, 4.0)
    check_real(self, "output_sigma", 0.0, 4.0)
    check_nonnegative(self, "seed")


@dataclasses.dataclass(frozen=True)
class KVMemoryStudy:
  """The study run by `kvjax run` for job "kv_memory". Contexts are capped at model.max_len.
  budget_tokens counts token slots in cache_dtype (None: the model's dtype); cache_dtypes are
  further cache formats served within the same bytes (`policies`); baselines=False leaves out
  max_len and doubling."""

  job: str = "kv_memory"
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  workload: WorkloadConfig = dataclasses.field(default_factory=WorkloadConfig)
  budget_tokens: int = 16384
  page_sizes: tuple[int, ...] = (8, 16, 32)
  baseline_page_size: int = 16
  num_slots: int = 64
  cache_dtype: str | None = None
  cache_dtypes: tuple[str, ...] = ()
  baselines: bool = True
  seed: int = 0

  def __post_init__(self):
    if self.job != "kv_memory":
      raise ValueError(f"KVMemoryStudy.job must be 'kv_memory', got {self.job!r}")
    for name, cls in (("model", ModelConfig), ("workload", WorkloadConfig)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"KVMemoryStudy.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
    check_positive(self, "budget_tokens", "baseline_page_size", "num_slots")
    if not self.page_sizes:
      raise ValueError(
        f"KVMemoryStudy.page_sizes must be a non-empty tuple of positive integers, got {self.page_sizes!r}"
      )
    for i, size in enumerate(self.page_sizes):
      check_positive_int(size, f"KVMemoryStudy.page_sizes[{i}]")
    for size in (*self.page_sizes, self.baseline_page_size):
      if self.budget_tokens % size:
        raise ValueError(
          f"KVMemoryStudy.budget_tokens={self.budget_tokens} is not a multiple of page "
          f"size {size}: every policy must get the same budget"
        )
    if self.budget_tokens < self.model.max_len:
      raise ValueError(
        f"KVMemoryStudy.budget_tokens={self.budget_tokens} cannot hold one request of "
        f"ModelConfig.max_len={self.model.max_len} positions"
      )
    if not isinstance(self.baselines, bool):
      raise ValueError(f"KVMemoryStudy.baselines must be a bool, got {self.baselines!r}")
    for where, name in [("cache_dtype", self.cache_dtype)] + [
      (f"cache_dtypes[{i}]", n) for i, n in enumerate(self.cache_dtypes)
    ]:
      if name is None and where == "cache_dtype":
        continue
      try:
        CacheConfig(layout="paged", dtype=name).codec(self.model)  # a format the heads can take (int4: even)
      except ValueError as err:
        raise ValueError(f"KVMemoryStudy.{where}: {err}") from None
    check_nonnegative(self, "seed")

  @property
  def headline_page_size(self) -> int:
    """The page size of the headline numbers and of the cache_dtypes runs: 16, or the first."""
    return 16 if 16 in self.page_sizes else self.page_sizes[0]

  def policies(self) -> list[tuple[str, int, str]]:
    """(allocation, page size, cache dtype) triples, baselines first, then the other cache formats."""
    own = CacheConfig(dtype=self.cache_dtype).codec(self.model).name
    baselines = [("max_len", self.baseline_page_size, own), ("doubling", self.baseline_page_size, own)]
    return (
      (baselines if self.baselines else [])
      + [("paged", size, own) for size in self.page_sizes]
      + [("paged", self.headline_page_size, name) for name in self.cache_dtypes]
    )


def make_workload(config: WorkloadConfig, max_len: int, vocab_size: int) -> list[tuple[np.ndarray, int]]:
  """Seeded (prompt int32[L], max_new_tokens) pairs with L + max_new_tokens - 1 <= max_len."""
  rng = np.random.default_rng(config.seed)
  requests = []
  for _ in range(config.num_requests):
    prompt_len = int(np.clip(round(config.prompt_median * rng.lognormal(0.0, config.prompt_sigma)), 1, max_len))
    output_len = int(
      np.clip(round(config.output_median * rng.lognormal(0.0, config.output_sigma)), 1, max_len - prompt_len + 1)
    )
    requests.append((rng.integers(0, vocab_size, prompt_len, dtype=np.int32), output_len))
  return requests


def serve(model: Transformer, params, workload, config: EngineConfig) -> tuple[dict, dict]:
  """Runs the workload through one engine; returns (metrics, outputs by request id). Compilation is
  done before the clock starts."""
  engine = Engine(model, params, config)
  engine.warmup()
  for prompt, max_new_tokens in workload:
    engine.submit(prompt, max_new_tokens)
  start = time.perf_counter()
  outputs = engine.run()
  seconds = time.perf_counter() - start
  stats = engine.stats
  page_size = config.cache.page_size
  budget = (config.num_pages - 1) * page_size
  metrics = {
    "policy": config.allocation if config.allocation != "paged" else f"paged{page_size}",
    "cache_dtype": config.cache.codec(model.config).name,
    "page_size": page_size,
    "budget_tokens": budget,
    "budget_bytes": budget * kinds.bytes_per_token(model.config, config.cache),
    "utilisation": stats.utilisation,
    "peak_concurrent": max(stats.running),
    "mean_concurrent": float(np.mean(stats.running)),
    "preemptions": stats.preemptions,
    "decode_steps": len(stats.running),
    "generated_tokens": stats.generated_tokens,
    "seconds": seconds,
    "tokens_per_s": stats.generated_tokens / seconds,
  }
  trace = {"running": list(stats.running), "cached": list(stats.cached), "allocated": list(stats.allocated)}
  return {**metrics, "trace": trace}, outputs


def run(study: KVMemoryStudy, workdir: str | Path, progress: Callable[[str], None] = print) -> list[dict]:
  """Serves the workload under every policy, one line of `progress` each; writes
  kv_memory.{md,csv,json,png} and the headline numbers (summary) as kv_memory_summary.json to
  workdir, claimed as a study's for the whole run (kvjax.training.workdir.claim_study); returns
  the rows."""
  with claim_study(workdir, study) as workdir:
    cfg = study.model
    params = Transformer(cfg).init(jax.random.key(study.seed), jnp.zeros((1, 1), jnp.int32))["params"]
    workload = make_workload(study.workload, cfg.max_len, cfg.vocab_size)
    budget_bytes = study.budget_tokens * kinds.bytes_per_token(cfg, CacheConfig(dtype=study.cache_dtype))
    rows, reference = [], None
    model = Transformer(cfg)
    for allocation, page_size, cache_dtype in study.policies():
      cache = CacheConfig(layout="paged", dtype=cache_dtype, page_size=page_size)
      pages = budget_bytes // (page_size * kinds.bytes_per_token(cfg, cache))
      engine_config = EngineConfig(
        num_slots=study.num_slots,
        num_pages=pages + 1,
        cache=cache,
        allocation=allocation,
        seed=study.seed,
        trace_steps=True,
      )
      row, outputs = serve(model, params, workload, engine_config)
      reference = outputs if reference is None else reference
      row["identical_outputs"] = sum(np.array_equal(reference[i], outputs[i]) for i in reference)
      rows.append(row)
      progress(
        f"kv_memory: {row['policy']} {cache_dtype}: utilisation {row['utilisation']:.3f}, peak concurrent "
        f"{row['peak_concurrent']}, {row['tokens_per_s']:.0f} tokens/s"
      )
    write_table([{k: r[k] for k in CSV_FIELDS} for r in rows], workdir / "kv_memory", [(k, k, "") for k in CSV_FIELDS])
    (workdir / "kv_memory.md").write_text(report(study, workload, rows))
    plot(rows, workdir / "kv_memory.png")
    (workdir / "kv_memory_summary.json").write_text(json.dumps(summary(rows), indent=2) + "\n")
    return rows


def summary(rows: list[dict]) -> dict:
  """The rows without their traces, and the headline numbers: paged utilisation at page size 16
  (or the first paged run) and its concurrency over contiguous max_len preallocation; per further
  cache format, its peak and mean concurrency over the model's own format at that page size."""
  own = rows[0]["cache_dtype"]
  paged = next(
    (r for r in rows if r["policy"] == "paged16" and r["cache_dtype"] == own),
    next(r for r in rows if r["policy"].startswith("paged")),
  )
  formats = {
    r["cache_dtype"]: {
      "peak_concurrent_over_" + own: r["peak_concurrent"] / paged["peak_concurrent"],
      "mean_concurrent_over_" + own: r["mean_concurrent"] / paged["mean_concurrent"],
    }
    for r in rows
    if r["cache_dtype"] != own
  }
  contiguous = next((r for r in rows if r["policy"] == "max_len"), None)
  if contiguous is None:
    return {
      "rows": [{k: r[k] for k in CSV_FIELDS} for r in rows],
      "cache_dtypes": formats,
      "paged_policy": paged["policy"],
      "paged_utilisation": paged["utilisation"],
    }
  return {
    "cache_dtypes": formats,
    "rows": [{k: r[k] for k in CSV_FIELDS} for r in rows],
    "paged_policy": paged["policy"],
    "paged_utilisation": paged["utilisation"],
    "peak_concurrent_over_max_len": paged["peak_concurrent"] / contiguous["peak_concurrent"],
    "mean_concurrent_over_max_len": paged["mean_concurrent"] / contiguous["mean_concurrent"],
    "tokens_per_s_over_max_len": paged["tokens_per_s"] / contiguous["tokens_per_s"],
  }


def report(study: KVMemoryStudy, workload, rows: list[dict]) -> str:
  prompts = np.array([p.size for p, _ in workload])
  outputs = np.array([n for _, n in workload])
  contiguous = next((r for r in rows if r["policy"] == "max_len"), None)
  columns = TABLE_COLUMNS if contiguous else [c for c in TABLE_COLUMNS if c[0] != "peak_over_max_len"]
  lines = [
    "# KV-memory study",
    "",
    f"Workload: {len(workload)} requests queued at once; prompt length median {int(np.median(prompts))}, "
    f"mean {prompts.mean():.0f}, max {prompts.max()}; output length median {int(np.median(outputs))}, "
    f"mean {outputs.mean():.0f}, max {outputs.max()}; contexts capped at max_len={study.model.max_len}.",
    f"KV budget: {study.budget_tokens} token slots in {rows[0]['cache_dtype']} = "
    f"{rows[0]['budget_bytes']} bytes for every policy (a quantized cache fits "
    f"more token slots in them); {study.num_slots} batch slots. Model: d_model {study.model.d_model}, "
    f"{study.model.num_layers} layers, {study.model.num_heads} heads, {study.model.num_kv_heads} kv heads.",
    f"Requests whose greedy tokens match the {rows[0]['policy']} run, per policy: "
    + ", ".join(f"{r['policy']} {r['cache_dtype']} {r['identical_outputs']}/{len(workload)}" for r in rows)
    + " (an allocation policy must not change what a request generates; a quantized cache may).",
    "",
    markdown_table(
      [
        {**r, "peak_over_max_len": r["peak_concurrent"] / contiguous["peak_concurrent"]} if contiguous else r
        for r in rows
      ],
      columns,
    ),
  ]
  lines += [
    "",
    "Utilisation: tokens cached / token slots allocated, summed over decode steps. "
    "Baselines are allocated in multiples of their page size. tokens/s: generated tokens over "
    "the wall time of serving the whole workload after compilation, same kernels for every policy "
    "(the paged vs contiguous kernel cost is `kvjax bench paged`).",
    "",
    "Reference, vLLM paper (ShareGPT/Alpaca traces on GPUs): KV memory holding real tokens, and concurrent requests:",
    "",
    markdown_table(
      [dict(zip(("system", "utilisation", "concurrent"), anchor)) for anchor in VLLM_ANCHORS],
      [("system", "system", ""), ("utilisation", "utilisation", ""), ("concurrent", "concurrent requests", "")],
    ),
  ]
  return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
  with figure(path, panels=2, size=(11, 4), dpi=110) as (bars, lines):
    own = rows[0]["cache_dtype"]
    names = [r["policy"] + ("" if r["cache_dtype"] == own else f" {r['cache_dtype']}") for r in rows]
    bars.bar(names, [100 * r["utilisation"] for r in rows], color="tab:blue")
    bars.set_ylabel("KV slots holding real tokens (%)")
    bars.set_ylim(0, 100)
    twin = bars.twinx()
    twin.plot(names, [r["peak_concurrent"] for r in rows], "o-", color="tab:red")
    twin.set_ylabel("peak concurrent requests", color="tab:red")
    twin.set_ylim(0, 1.1 * max(r["peak_concurrent"] for r in rows))
    bars.set_title("Utilisation and concurrency within one KV budget")
    for name, r in zip(names, rows):
      lines.plot(r["trace"]["running"], label=name)
    lines.set_xlabel("decode step")
    lines.set_ylabel("running requests")
    lines.set_title("Concurrency over the run")
    lines.legend()
