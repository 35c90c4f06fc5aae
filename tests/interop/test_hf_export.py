"""Export to Hugging Face, for every family that imports: transformers loads what kvjax writes and
computes the same logits and greedy tokens; import -> export gives back the original tensors
bitwise, and export -> import the original params; clear refusals."""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import kvjax
from kvjax.cli import main as cli
from kvjax.interop.importer import flatten, from_hf
from kvjax.interop.hf_export import export_hf
from kvjax.training import checkpoint
from conftest import init_params, tiered

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


GPT2 = dict(positions="learned", norm="layernorm", activation="gelu", num_kv_heads=4)
# (config changes, the family that writes it, what import gives back differently: zero biases a
# family adds, GPT-2's default rope_theta, which a model without RoPE never reads).
CASES = [
  ({}, "llama", {}),
  (dict(qkv_bias=True, tie_embeddings=True), "qwen2", {}),
  (dict(qkv_bias=True, use_bias=True), "llama", {}),
  (dict(use_bias=True, num_kv_heads=1), "llama", dict(qkv_bias=True)),  # o / MLP biases only
  (dict(GPT2, qkv_bias=True, use_bias=True, tie_embeddings=True), "gpt2", dict(rope_theta=10_000.0)),
  (dict(GPT2, qkv_bias=True, use_bias=True, rope_theta=10_000.0), "gpt2", {}),  # untied
  (dict(GPT2, mlp_dim=48, rope_theta=10_000.0), "gpt2", dict(qkv_bias=True, use_bias=True)),  # no biases
]


@pytest.mark.parametrize("changes, family, _", tiered(CASES, (CASES[1], CASES[3], CASES[6])))
def test_transformers_runs_the_export_with_kvjax_logits_and_tokens(tmp_path, changes, family, _):
  cfg = config(**changes)
  params = random_params(cfg)
  assert export_hf(params, cfg, tmp_path / "hf")["family"] == family
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  assert type(hf_model).__name__ == json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
  model = kvjax.Transformer(cfg)
  ours = np.asarray(model.apply({"params": params}, PROMPTS[:1]))
  with torch.inference_mode():
    theirs = hf_model(torch.from_numpy(PROMPTS[:1].astype(np.int64))).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
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


@pytest.mark.parametrize("changes, family, comes_back", CASES)
def test_export_then_import_gives_back_the_params_bitwise(tmp_path, changes, family, comes_back):
  cfg = config(**changes)
  params = random_params(cfg)
  export_hf(params, cfg, tmp_path / "hf")
  imported, cfg_again = from_hf(tmp_path / "hf")
  assert cfg_again == cfg.replace(**comes_back)
  ours, theirs = flatten(params), flatten(imported)
  assert set(ours) <= set(theirs)
  for path, value in theirs.items():
    want = np.asarray(ours[path]) if path in ours else np.zeros_like(value)  # an added bias is zeros
    assert want.dtype == value.dtype and np.array_equal(want, value), path


def hf_model(family: str):
  """A small random transformers model of `family`, its 1-D weights moved off their init."""
  common = dict(vocab_size=96, bos_token_id=None, eos_token_id=None, pad_token_id=None)
  llama = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **common)
  llama.update(num_key_value_heads=2, max_position_embeddings=64)
  made = {
    "llama_attention_bias": lambda: transformers.LlamaForCausalLM(
      transformers.LlamaConfig(**llama, attention_bias=True)
    ),
    "llama_mlp_bias": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama, mlp_bias=True)),
    "qwen2_tied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama, tie_word_embeddings=True)),
    "gpt2_tied": lambda: transformers.GPT2LMHeadModel(
      transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, **common)
    ),
    "gpt2_untied": lambda: transformers.GPT2LMHeadModel(
      transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=48, tie_word_embeddings=False, **common)
    ),
  }
  torch.manual_seed(0)
  model = made[family]().eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.dim() == 1:
        p.add_(0.2 * torch.randn_like(p))
  return model


@pytest.mark.parametrize("family", ["llama_attention_bias", "llama_mlp_bias", "qwen2_tied", "gpt2_tied", "gpt2_untied"])
def test_import_then_export_gives_back_the_tensors_bitwise(tmp_path, family):
  hf_model(family).save_pretrained(tmp_path / "src", safe_serialization=True)
  params, cfg = from_hf(tmp_path / "src")
  assert export_hf(params, cfg, tmp_path / "out")["family"] == family.split("_")[0]
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
  gqa_gpt2 = config(**{**GPT2, "num_kv_heads": 2})
  with pytest.raises(ValueError, match="no Hugging Face family") as refused:
    export_hf(random_params(gqa_gpt2), gqa_gpt2, tmp_path / "gpt2")
  assert "llama: it cannot hold activation='gelu'" in str(refused.value)
  assert "gpt2: it cannot hold num_kv_heads=2 (its models have 4)" in str(refused.value)
  assert not (tmp_path / "gpt2").exists()
  biased = config(qkv_bias=True)
  params = random_params(biased)
  del params["layers_1"]["attn"]["v"]["bias"]
  with pytest.raises(ValueError, match="params have no layers_1/attn/v/bias, which the model config implies"):
    export_hf(params, biased, tmp_path / "lacking")
  windowed = config(window=(8, 0))
  with pytest.raises(ValueError, match=r"window=\(8, 0\) \(its models have \(\)\)"):
    export_hf(random_params(windowed), windowed, tmp_path / "windowed")
  assert not (tmp_path / "windowed").exists()
  occupied = tmp_path / "occupied"
  occupied.mkdir()
  (occupied / "notes.txt").write_text("keep me")
  before = tree_hash(occupied)
  with pytest.raises(ValueError, match="must not exist or be empty"):
    export_hf(random_params(config()), config(), occupied)
  assert tree_hash(occupied) == before


@pytest.mark.parametrize("changes, family", [({}, "llama"), (dict(GPT2, use_bias=True, qkv_bias=True), "gpt2")])
def test_export_hf_command_writes_the_latest_checkpoint(tmp_path, capsys, changes, family):
  cfg = config(**changes)
  params = random_params(cfg)
  checkpoint.save_params(tmp_path / "run", params, cfg)
  assert cli.main(["export-hf", "--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert result["family"] == family and sorted(result["files"]) == ["config.json", "model.safetensors"]
  imported, imported_cfg = from_hf(tmp_path / "hf")
  assert imported_cfg.replace(dtype=cfg.dtype, rope_theta=cfg.rope_theta) == cfg
  np.testing.assert_array_equal(imported["layers_1"]["attn"]["q"]["kernel"], params["layers_1"]["attn"]["q"]["kernel"])
