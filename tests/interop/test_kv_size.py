"""KV-size planner: published numbers, agreement with the caches kvjax allocates, and fitting."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from kvjax.cli import main as cli
from kvjax.cache.contiguous import ContiguousCache
from kvjax.config import ModelConfig
from kvjax.interop import kv_size
from kvjax.interop.kv_size import PRESETS, Architecture, count_params, parse_bytes, plan, resolve
from kvjax.model.params import abstract_params
from kvjax.training import checkpoint

KIB = 1024


def run_cli(*argv: str, capsys) -> str:
  assert cli.main(["kv-size", *argv]) == 0
  return capsys.readouterr().out


def test_checked_numbers_bf16(capsys):
  assert plan(resolve("Qwen2-7B"), context=1, batch=1)["bytes_per_token"] == 56 * KIB
  out = json.loads(run_cli("llama-3-70b", "--dtype", "bf16", "--json", capsys=capsys))
  assert out["bytes_per_token"] == 320 * KIB
  by_heads = {row["kv_heads"]: row["bytes_per_token"] for row in out["variants"]}
  assert by_heads[64] == 8 * 320 * KIB and by_heads[1] == 320 * KIB // 8  # MHA, MQA
  assert [row["as_built"] for row in out["variants"]].count(True) == 1


def _kvjax_equivalent(arch: Architecture) -> ModelConfig:
  """The kvjax ModelConfig of a dense preset, with its family's biases and tying."""
  gpt2 = arch.name == "GPT-2"
  qwen = arch.name.startswith("Qwen2")
  return ModelConfig(
      vocab_size=arch.vocab_size, d_model=arch.d_model, num_layers=arch.num_layers,
      num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
      mlp_dim=arch.mlp_dim, activation="gelu" if gpt2 else "swiglu",
      norm="layernorm" if gpt2 else "rmsnorm", positions="learned" if gpt2 else "rope",
      qkv_bias=gpt2 or qwen, use_bias=gpt2, max_len=1024,
      tie_embeddings=gpt2 or arch.name in ("Qwen2-0.5B", "Qwen2-1.5B"))


@pytest.mark.parametrize("name", ["Qwen2-0.5B", "Qwen2-1.5B", "Qwen2-7B", "Qwen2-72B",
                                  "Llama-2-70B", "Llama-3-70B", "GPT-2"])
def test_dense_presets_match_their_published_parameter_counts(name):
  arch = PRESETS[name]
  config = _kvjax_equivalent(arch)
  assert count_params(config) == arch.params
  assert arch.bytes_per_token("bf16") == config.replace(cache_dtype="bfloat16").kv_bytes_per_token


def test_bytes_per_token_matches_an_allocated_cache():
  config = ModelConfig(vocab_size=64, d_model=48, num_layers=3, num_heads=6, num_kv_heads=2,
                       max_len=32, cache_dtype="bfloat16")
  batch, max_len = 3, 20
  cache = ContiguousCache.create(config, batch, max_len)
  allocated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache.layers))
  result = plan(kv_size.from_model_config("tiny", config), context=max_len, batch=batch, dtype="bf16")
  assert result["cache_bytes"] == allocated
  assert result["architecture"]["params"] == sum(x.size for x in jax.tree.leaves(abstract_params(config)))


def test_fitting_is_the_largest_that_fits():
  arch = PRESETS["Qwen2-7B"]
  memory = parse_bytes("80GB")
  result = plan(arch, context=8192, batch=4, device_memory=memory)
  free = memory - arch.params * 2
  assert result["free_bytes_per_device"] == free
  per_token = 56 * KIB
  assert result["max_batch"] * 8192 * per_token <= free < (result["max_batch"] + 1) * 8192 * per_token
  assert result["max_context"] * 4 * per_token <= free < (result["max_context"] + 1) * 4 * per_token
  # Smaller kv-head counts never fit less.
  batches = [row["max_batch"] for row in result["variants"]]
  assert batches == sorted(batches) and batches[0] < batches[-1]


def test_tensor_parallel_replicates_kv_heads_beyond_their_count():
  result = plan(PRESETS["Llama-3-70B"], context=8192, batch=1, device_memory=parse_bytes("80GB"),
                devices=8)
  by_heads = {row["kv_heads"]: row["max_batch"] for row in result["variants"]}
  # With 8 devices each holds one of the 8 kv heads; fewer kv heads are replicated, so MQA
  # saves nothing per device. On one device the weights alone do not fit.
  assert by_heads[8] == by_heads[4] == by_heads[1] > by_heads[16] > 0
  assert plan(PRESETS["Llama-3-70B"], context=1, batch=1, device_memory=parse_bytes("80GB"))["max_batch"] == 0


def test_models_from_config_file_workdir_and_hf_dir(tmp_path):
  config = ModelConfig(vocab_size=96, d_model=64, num_layers=2, num_heads=8, num_kv_heads=2)
  (tmp_path / "cfg.py").write_text(
      "import types\nfrom kvjax.config import ModelConfig\n"
      f"def get_config():\n  return types.SimpleNamespace(job='train', model=ModelConfig(**{config.to_dict()!r}))\n")
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps({"job": "train", "model": config.to_dict()}))
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(json.dumps(dict(
      model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=config.mlp_dim,
      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
      max_position_embeddings=1024, tie_word_embeddings=False)))
  for spec in (tmp_path / "cfg.py", workdir, hf_dir):
    arch = resolve(str(spec))
    assert arch.bytes_per_token("fp32") == config.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4
  assert resolve(str(workdir)).params == count_params(config)
  assert resolve(str(hf_dir)).params == count_params(config.replace(qkv_bias=True))


def test_a_params_checkpoint_names_its_model_in_config_json(tmp_path):
  config = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2)
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(config))
  workdir = tmp_path / "imported"
  checkpoint.save_params(workdir, params, config)
  assert resolve(str(workdir)) == kv_size.from_model_config("imported", config)
  (workdir / "config.json").unlink()
  with pytest.raises(ValueError, match="holds checkpoints but no config.json"):
    resolve(str(workdir))


def test_text_output_and_errors(capsys, tmp_path):
  out = run_cli("qwen2-7b", "--context", "1024", "--batch", "2", "--device-memory", "24GiB", capsys=capsys)
  assert "* GQA" in out and "56.0 KiB" in out and "max batch" in out
  with pytest.raises(ValueError, match="Qwen2-7B"):
    resolve("no-such-model")
  with pytest.raises(ValueError, match="'80 gigs'"):
    parse_bytes("80 gigs")
  assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("1.5e9") == 1_500_000_000
  with pytest.raises(ValueError, match="context must be a positive integer"):
    plan(PRESETS["GPT-2"], context=0, batch=1)
  with pytest.raises(ValueError, match="dtype 'fp4'"):
    plan(PRESETS["GPT-2"], context=1, batch=1, dtype="fp4")
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
  with pytest.raises(ValueError, match="'bert'"):
    resolve(str(tmp_path))


def test_windowed_layers_stop_growing_at_window_plus_sinks():
  config = ModelConfig(vocab_size=64, d_model=48, num_layers=3, num_heads=6, num_kv_heads=2,
                       max_len=32, window=(4, 0), sink_tokens=2)  # layers 0 and 2 keep 6 positions
  arch = kv_size.from_model_config("windowed", config)
  for context in (3, 6, 20):
    cache = ContiguousCache.create(config, 2, context)
    assert plan(arch, context=context, batch=2, dtype="fp32")["cache_bytes"] == cache.nbytes
    for fmt in ("int8", "int4", "float8_e4m3fn"):  # quantized windowed layers: values and scales
      quantized = ContiguousCache.create(config.replace(cache_dtype=fmt), 2, context)
      assert plan(arch, context=context, batch=2, dtype=fmt)["cache_bytes"] == quantized.nbytes
  per_position = 2 * 2 * 8 * 4  # K and V, 2 kv heads, head dim 8, float32: one layer, one position
  free = 2 * per_position * (12 + 100)
  # One global layer grows; the two windowed ones hold 6 positions each from context 6 on.
  assert arch.max_context(free, 2, "fp32") == 100
  every = dataclasses.replace(arch, window=(4,))
  assert every.max_context(free, 2, "fp32") is None and every.max_context(2 * per_position * 17, 2, "fp32") == 5
  # An MLA variant (latent 20 + rotary 4 per position) keeps the same positions per layer.
  latent_row = plan(arch, context=20, batch=2, dtype="fp32", device_memory=free + arch.params * 4,
                    mla=((20, 4),))["variants"][0]
  assert latent_row["variant"] == "MLA 20+4" and latent_row["bytes_per_token"] == 3 * 24 * 4
  assert latent_row["cache_bytes"] == 2 * 24 * 4 * (20 + 6 + 6)
  assert latent_row["max_context"] == (free // (2 * 24 * 4)) - 12
  with pytest.raises(ValueError, match="an MLA cache in 'int8'"):
    plan(arch, context=20, batch=2, dtype="int8", mla=((20, 4),))
  result = plan(PRESETS["Gemma-2-9B"], context=32768, batch=1, device_memory=parse_bytes("80GB"))
  full = PRESETS["Gemma-2-9B"].bytes_per_token("bf16") * 32768
  assert result["cache_bytes"] == full // 2 + full // 2 // 32768 * 4096  # 21 local layers keep 4096
  mistral = plan(PRESETS["Mistral-7B-v0.1"], context=10**6, batch=1, device_memory=parse_bytes("24GB"))
  assert mistral["max_context"] is None and mistral["cache_bytes"] == 128 * 2**10 * 4096
  assert count_params(_kvjax_equivalent(PRESETS["Mistral-7B-v0.1"])) == PRESETS["Mistral-7B-v0.1"].params


def test_named_pretrained_model_from_its_gguf_metadata():
  arch = resolve("smollm2-135m")  # the metadata alone: no tensor is read
  assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
  assert arch.bytes_per_token("bfloat16") == 2 * 30 * 3 * 64 * 2
