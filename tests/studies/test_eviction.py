"""The eviction study on SmolLM2, shrunk (configs/eviction/tiny.py): one press beside the full
cache, both recall protocols with an answer budget that holds the key, perplexity after a
pressed context; the full cache's rows against oracles."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from kvjax.cli.run import load_config
from kvjax.interop.importer import read_model
from kvjax.model.transformer import Transformer
from kvjax.studies import eviction
from kvjax.studies.base import measure
from kvjax.studies.eviction import EvictionStudy
from kvjax.studies.base.scoring import read_jsonl
from kvjax.training.config import DataConfig
from kvjax.training.data import PROSE, eval_batches, load_dataset

ROOT = Path(__file__).parents[2]


def forward_perplexity(study: EvictionStudy, params, config, tokenizer) -> float:
  """The oracle: a causal forward pass over each whole window, its continuation scored."""
  length = study.perplexity_context + study.continuation
  data = load_dataset(DataConfig(source=PROSE, seq_len=length), tokenizer)
  total = count = 0
  for inputs, targets in eval_batches(data.val, length, study.windows, 1):
    logits = Transformer(config).apply({"params": params}, inputs)
    nll = -jax.nn.log_softmax(logits, axis=-1)[:, study.perplexity_context :]
    picked = np.take_along_axis(np.asarray(nll), targets[:, study.perplexity_context :, None].astype(np.int64), -1)
    total += float(picked.sum())
    count += picked.size
  return math.exp(total / count)


@pytest.mark.tier2
def test_the_tiny_study_writes_a_row_per_cache(tmp_path):
  study = load_config(ROOT / "configs" / "eviction" / "tiny.py")
  progress = []
  rows = eviction.run(study, tmp_path, progress.append)
  assert progress == ["eviction: measuring the full cache", "eviction: measuring snapkv at ratio 0.75"]
  assert [(r["press"], r["ratio"]) for r in rows] == [("full cache", 0.0), ("snapkv", 0.75)]
  full, snapkv = rows
  # Through the full cache the model finds both keys in prompts of 200 tokens ("The secret
  # passkey is 12345.", inside the 24-token budget), under either protocol, answering alike token
  # for token: reading the question after the prefill is reading it in the prompt.
  assert full["recall_query_agnostic"] == full["recall_query_aware"] == 100.0
  agnostic, aware = ([s for s in full["samples"] if s["protocol"] == p] for p in measure.PROTOCOLS)
  assert [s["answer"] for s in agnostic] == [s["answer"] for s in aware]
  params, config, tokenizer, _ = read_model(study.source)
  contexts, question, samples = eviction.needles(tokenizer, study)
  assert contexts.shape == (2, 200 - len(question)) and all(s["answer_tokens"] == 24 for s in samples)
  assert [s["answer"] for s in agnostic] == [f"The secret passkey is {s['references'][0]}." for s in samples]
  for row in rows:
    for protocol in measure.PROTOCOLS:
      found = [s for s in row["samples"] if s["protocol"] == protocol]
      assert [s["id"] for s in found] == [s["id"] for s in samples]
      assert {s["method"] for s in found} == {"full" if row["press"] == "full cache" else "snapkv@0.75"}
  assert read_jsonl(tmp_path / "samples.jsonl") == samples
  assert read_jsonl(tmp_path / "answers.jsonl") == [s for row in rows for s in row["samples"]]
  assert full["perplexity"] == pytest.approx(forward_perplexity(study, params, config, tokenizer), rel=1e-4)
  # The press dropped what the continuation reads; pressing before or after the question arrives
  # keeps other tokens, so the two protocols answer differently.
  assert snapkv["perplexity"] != pytest.approx(full["perplexity"], rel=1e-4)
  agnostic, aware = ([s["answer"] for s in snapkv["samples"] if s["protocol"] == p] for p in measure.PROTOCOLS)
  assert agnostic != aware
  assert json.loads((tmp_path / "eviction.json").read_text()) == rows
  assert "| snapkv |" in (tmp_path / "eviction.md").read_text()


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(presses=("h2o",)), "EvictionStudy.presses: 'h2o' is not one of"),
    (dict(ratios=(1.0,)), "compression_ratio must be a finite number in"),
    (dict(context=64), "EvictionStudy.context must be at least 128"),
    (dict(trials=0), "trials"),
    (dict(answer_tokens=0), "EvictionStudy.answer_tokens must be"),
  ],
)
def test_bad_studies_are_refused_naming_the_field(changes, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    EvictionStudy(**changes)
