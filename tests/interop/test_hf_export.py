"""Export to Hugging Face: transformers loads what kvjax writes and computes the same logits and
greedy tokens; import -> export gives back the original tensors bitwise; clear refusals."""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import kvjax
from kvjax.cli import main as cli
from kvjax.interop.importer import from_hf
from kvjax.interop.hf_export import export_hf
from kvjax.training import checkpoint
from conftest import init_params

transformers = pytest.importorskip(
  "transformers", reason="parity needs transformers + torch (pip install kvjax[bench])"
)
torch = pytest.importorskip("torch")

PROMPTS = np.array([[5, 9, 2, 7, 1, 3], [4, 8, 6, 0, 0, 0]], np.int32)
LENGTHS = np.array([6, 3])


def config(**changes) -> kvjax.ModelConfig:
  base = dict(
    vocab_size=96,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=64,
    max_len=64,
    norm_eps=1e-5,
    rope_theta=500.0,
  )
  return kvjax.ModelConfig(**{**base, **changes})


def random_params(cfg, seed=0):
  """Random weights with norm scales and biases moved off their init, so a dropped one shows."""
  _, params = init_params(cfg, seed)
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  return jax.tree.unflatten(
    tree, [(np.asarray(x) + (0.2 * rng.standard_normal(x.shape) if x.ndim == 1 else 0)).astype(x.dtype) for x in leaves]
  )


@pytest.mark.parametrize(
  "changes, family",
  [
    ({}, "llama"),
    (dict(qkv_bias=True, tie_embeddings=True), "qwen2"),
    (dict(qkv_bias=True, use_bias=True), "llama"),
    (dict(use_bias=True, num_kv_heads=1), "llama"),  # o / MLP biases only: zero q/k/v biases
  ],
)
def test_transformers_runs_the_export_with_kvjax_logits_and_tokens(tmp_path, changes, family):
  cfg = config(**changes)
  params = random_params(cfg)
  assert export_hf(params, cfg, tmp_path / "hf")["family"] == family
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  model = kvjax.Transformer(cfg)
  ours = np.asarray(model.apply({"params": params}, PROMPTS[:1]))
  with torch.inference_mode():
    theirs = hf_model(torch.from_numpy(PROMPTS[:1].astype(np.int64))).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
  tokens = np.asarray(kvjax.generate(model, params, PROMPTS[:1], LENGTHS[:1], 8))
  with torch.inference_mode():
    generated = hf_model.generate(
      torch.from_numpy(PROMPTS[:1].astype(np.int64)),
      max_new_tokens=8,
      min_new_tokens=8,
      do_sample=False,
      pad_token_id=0,
      eos_token_id=None,
    )
  np.testing.assert_array_equal(tokens[0], generated[0, PROMPTS.shape[1] :].numpy())


def test_import_then_export_gives_back_the_tensors_bitwise(tmp_path):
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(
    transformers.LlamaConfig(
      vocab_size=96,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=64,
      attention_bias=True,
    )
  ).eval()
  hf.save_pretrained(tmp_path / "src", safe_serialization=True)
  params, cfg = from_hf(tmp_path / "src")
  export_hf(params, cfg, tmp_path / "out")
  original, exported = (
    load_file(tmp_path / "src" / "model.safetensors"),
    load_file(tmp_path / "out" / "model.safetensors"),
  )
  assert sorted(original) == sorted(exported)
  for name, value in original.items():
    assert value.dtype == exported[name].dtype and np.array_equal(value, exported[name]), name
  params_again, cfg_again = from_hf(tmp_path / "out")
  assert cfg_again == cfg


def tree_hash(path) -> str:
  digest = hashlib.sha256()
  for f in sorted(p for p in path.rglob("*") if p.is_file()):
    digest.update(str(f.relative_to(path)).encode() + f.read_bytes())
  return digest.hexdigest()


def test_refusals_write_nothing(tmp_path):
  gpt2_like = config(positions="learned", norm="layernorm", activation="gelu")
  with pytest.raises(ValueError, match="positions='learned', norm='layernorm', activation='gelu' has no Hugging Face"):
    export_hf(random_params(gpt2_like), gpt2_like, tmp_path / "gpt2")
  assert not (tmp_path / "gpt2").exists()
  windowed = config(window=(8, 0))
  with pytest.raises(ValueError, match=r"window=\(8, 0\) has no Hugging Face"):
    export_hf(random_params(windowed), windowed, tmp_path / "windowed")
  assert not (tmp_path / "windowed").exists()
  occupied = tmp_path / "occupied"
  occupied.mkdir()
  (occupied / "notes.txt").write_text("keep me")
  before = tree_hash(occupied)
  with pytest.raises(ValueError, match="must not exist or be empty"):
    export_hf(random_params(config()), config(), occupied)
  assert tree_hash(occupied) == before


def test_export_hf_command_writes_the_latest_checkpoint(tmp_path, capsys):
  cfg = config()
  params = random_params(cfg)
  checkpoint.save_params(tmp_path / "run", params, cfg)
  assert cli.main(["export-hf", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert result["family"] == "llama" and sorted(result["files"]) == ["config.json", "model.safetensors"]
  imported, imported_cfg = from_hf(tmp_path / "hf")
  assert imported_cfg.replace(dtype=cfg.dtype) == cfg
  np.testing.assert_array_equal(imported["layers_1"]["attn"]["q"]["kernel"], params["layers_1"]["attn"]["q"]["kernel"])
