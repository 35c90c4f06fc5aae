"""`kvjax uptrain --to-mla` end to end on a tiny source run: an ordinary checkpoint of the MLA
model that loads, evaluates and generates through the latent caches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.cli.main import main
from kvjax.config import ModelConfig
from kvjax.training import checkpoint, train
from conftest import tiny_run, word_corpus

MODEL = ModelConfig(d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=64, max_len=64)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp("source")
  corpus = word_corpus(root / "words.txt", 2)
  train.run(tiny_run(MODEL, corpus, 8), root / "gqa")
  return root / "gqa"


@pytest.mark.tier2  # a whole uptraining and generate; the conversion's exactness is test_convert_mla's
def test_uptrain_to_mla_gives_a_checkpoint_that_generates(source, tmp_path, capsys):
  dest = tmp_path / "mla"
  assert (
    main(
      [
        "uptrain",
        "--from",
        str(source),
        "--workdir",
        str(dest),
        "--to-mla",
        "12",
        "--rope-dims",
        "4",
        "--fraction",
        "0.5",
        "--distill",
        "0.5",
      ]
    )
    == 0
  )
  assert "uptrained (alpha=0.5)" in capsys.readouterr().out
  record = json.loads((dest / "uptrain.json").read_text())
  assert (
    record["conversion"] == {"kv_latent_rank": 12, "rope_dims": 4, "factorisation": "activation"}
    and record["steps"] == 4
  )
  model, params, config = checkpoint.load_model(dest)
  assert model.config.is_latent and model.config.rope_dims == 4 and len(model.config.rope_pairs) == 1
  assert kinds.bytes_per_token(model.config) == (12 + 4) * 4
  prompts, lengths = np.array([[5, 6, 7, 8], [9, 10, 0, 0]]), np.array([4, 2])
  tokens = np.asarray(kvjax.generate(model, params, prompts, lengths, 6))
  # The greedy tokens through the latent cache are the full forward pass's, one by one.
  logits = model.apply({"params": params}, np.concatenate([prompts[0], tokens[0]])[None])[0, 3:-1]
  np.testing.assert_array_equal(np.argmax(logits, axis=-1), tokens[0])
  assert main(["eval", "--workdir", str(dest)]) == 0
  assert main(["generate", "--workdir", str(dest), "--prompt", "ab", "--max-new-tokens", "4"]) == 0


def test_uptrain_to_mla_errors(source, tmp_path, capsys):
  dest = tmp_path / "mla"
  assert main(["uptrain", "--from", str(source), "--workdir", str(dest), "--to-mla", "40", "--rope-dims", "4"]) == 2
  assert "kvjax uptrain: error: kv_latent_rank=40 is larger than possible" in capsys.readouterr().err
  assert main(["uptrain", "--from", str(source), "--workdir", str(dest), "--to-mla", "8"]) == 2
  assert "--rope-dims D go together" in capsys.readouterr().err
  assert (
    main(
      ["uptrain", "--from", str(source), "--workdir", str(dest), "--kv-heads", "1", "--to-mla", "8", "--rope-dims", "4"]
    )
    == 2
  )
  assert "exactly one of --kv-heads" in capsys.readouterr().err
  assert (
    main(
      ["uptrain", "--from", str(source), "--workdir", str(dest), "--to-mla", "8", "--rope-dims", "4", "--method", "pca"]
    )
    == 2
  )
  assert "--method and --seed choose how kv heads are regrouped (--kv-heads), not --to-mla" in capsys.readouterr().err
  assert main(["uptrain", "--from", str(source), "--workdir", str(dest), "--kv-heads", "1", "--rope-dims", "4"]) == 2
  assert "--rope-dims D goes with --to-mla RANK" in capsys.readouterr().err
  assert main(["uptrain", "--from", str(source), "--workdir", str(dest), "--kv-heads", "1", "--seed", "2"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("kvjax uptrain: error: KVHeads.seed=2 seeds method='random' only") and err.count("\n") == 1
  assert not dest.exists()
