"""KV-size planner: published numbers, agreement with the caches kvjax allocates, and fitting."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from kvjax.cache import kinds
from kvjax.cache.config import CacheConfig
from kvjax.cli import main as cli
from kvjax.config import ModelConfig
from kvjax.interop import architectures, kv_size
from kvjax.interop.architectures import PRESETS, resolve
from kvjax.interop.kv_size import parse_bytes, plan
from kvjax.model.params import abstract_params, param_count
from kvjax.training import checkpoint

KIB = 1024
CODECS = ("float32", "bfloat16", "int8", "int4", "float8_e4m3fn")
# A K/V model and an MLA one (latent 20 + rotary key 4 per token), three layers each.
KV = ModelConfig(vocab_size=64, d_model=48, num_layers=3, num_heads=6, num_kv_heads=2, max_len=32)
MLA = KV.replace(kv_latent_rank=20, rope_dims=4)
WINDOWED = dict(window=(4, 0), sink_tokens=2)  # layers 0 and 2 keep 6 positions in a contiguous cache


def run_cli(*argv: str, capsys) -> str:
  assert cli.main(["kv-size", *argv]) == 0
  return capsys.readouterr().out


def allocated(cache) -> int:
  """Bytes of every array of a cache: its layers and its bookkeeping (lengths, page table)."""
  return sum(x.nbytes for x in jax.tree.leaves(cache))


def test_checked_numbers_bf16(capsys):
  assert plan(resolve("Qwen2-7B"), context=1, batch=1)["bytes_per_token"] == 56 * KIB
  out = json.loads(run_cli("llama-3-70b", "--dtype", "bf16", "--json", capsys=capsys))
  assert out["bytes_per_token"] == 320 * KIB
  by_heads = {row["kv_heads"]: row["bytes_per_token"] for row in out["variants"]}
  assert by_heads[64] == 8 * 320 * KIB and by_heads[1] == 320 * KIB // 8  # MHA, MQA
  assert [row["as_built"] for row in out["variants"]].count(True) == 1
  assert out["architecture"]["num_kv_heads"] == 8 and out["architecture"]["params"] == 70_553_706_496


@pytest.mark.parametrize(
  "name",
  ["Qwen2-0.5B", "Qwen2-1.5B", "Qwen2-7B", "Qwen2-72B", "Llama-2-70B", "Llama-3-70B", "GPT-2", "Mistral-7B-v0.1"],
)
def test_dense_presets_match_their_published_parameter_counts(name):
  assert param_count(PRESETS[name].config) == PRESETS[name].params


def test_presets_of_imported_families_take_their_traits_from_the_family_entries():
  # Qwen2: q/k/v biases only, untied at 7B; GPT-2: learned positions, LayerNorm (eps 1e-5), tanh
  # GELU of 4 x d_model, biases everywhere, tied embeddings; none of it written in the presets.
  qwen = PRESETS["Qwen2-7B"].config
  assert (qwen.qkv_bias, qwen.use_bias, qwen.tie_embeddings, qwen.norm, qwen.activation) == (
    True,
    False,
    False,
    "rmsnorm",
    "swiglu",
  )
  gpt2 = PRESETS["GPT-2"].config
  assert (gpt2.positions, gpt2.norm, gpt2.norm_eps, gpt2.activation, gpt2.mlp_dim) == (
    "learned",
    "layernorm",
    1e-5,
    "gelu",
    3072,
  )
  assert gpt2.qkv_bias and gpt2.use_bias and gpt2.tie_embeddings and gpt2.max_len == 1024
  assert PRESETS["Mistral-7B-v0.1"].config.window == (4096,)


def test_presets_the_config_does_not_fully_express():
  for name in ("Gemma-2-9B", "Gemma-3-270M"):  # post-norms (and Gemma 3's q / k norms) counted
    assert param_count(PRESETS[name].config) == PRESETS[name].params
  for name in ("Qwen2-57B-A14B", "T5.1.1-XXL-decoder"):  # experts; the encoder and cross-attention
    assert PRESETS[name].note and param_count(PRESETS[name].config) < PRESETS[name].params


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", CODECS)
@pytest.mark.parametrize("model", ["kv", "mla", "kv_windowed", "mla_windowed"])
def test_planner_counts_what_the_cache_kinds_allocate(model, dtype, layout):
  config = {"kv": KV, "mla": MLA}[model.removesuffix("_windowed")]
  config = config.replace(**WINDOWED) if model.endswith("_windowed") else config
  batch, context, page_size = 3, 20, 8
  cache_config = CacheConfig(layout=layout, dtype=dtype, page_size=page_size)
  result = plan(
    architectures.from_model_config("tiny", config),
    context=context,
    batch=batch,
    dtype=dtype,
    layout=layout,
    page_size=page_size,
    mla=((20, 4),),
  )
  # Every row against a cache of the model it names, built here, not by the planner.
  models = {("MLA 20+4", 2): MLA.replace(window=config.window, sink_tokens=config.sink_tokens)}
  models.update(
    {
      (name, k): config.replace(num_kv_heads=k, kv_latent_rank=0, rope_dims=0)
      for name, k in (("MHA", 6), ("GQA", 3), ("GQA", 2), ("MQA", 1))
    }
  )
  rows = result["variants"]
  assert [(row["variant"], row["kv_heads"]) for row in rows] == [("MLA 20+4", 2)] * (1 + config.is_latent) + [
    ("MHA", 6),
    ("GQA", 3),
    ("GQA", 2),
    ("MQA", 1),
  ]
  for row in rows:
    variant = models[row["variant"], row["kv_heads"]]
    cache = kinds.create(variant, cache_config, batch, context)
    assert row["cache_bytes"] == allocated(cache), row
    # Per token: every layer at every position, as a cache that keeps them all stores it.
    whole = kinds.create(variant.replace(window=(), sink_tokens=0), cache_config, batch, context)
    positions = whole.num_pages * page_size if layout == "paged" else batch * context
    assert row["bytes_per_token"] * positions == whole.nbytes, row
  built = rows[0] if config.is_latent else rows[-2]
  assert built["as_built"] and [row["as_built"] for row in rows].count(True) == 1
  assert (result["bytes_per_token"], result["cache_bytes"]) == (built["bytes_per_token"], built["cache_bytes"])


def test_fitting_is_the_largest_that_fits():
  arch = PRESETS["Qwen2-7B"]
  memory = parse_bytes("80GB")
  result = plan(arch, context=8192, batch=4, device_memory=memory)
  free = memory - arch.params * 2
  assert result["free_bytes_per_device"] == free
  cache = lambda batch, context: kinds.cache_bytes(arch.config, CacheConfig(dtype="bf16"), batch, context)
  assert cache(result["max_batch"], 8192) <= free < cache(result["max_batch"] + 1, 8192)
  assert cache(4, result["max_context"]) <= free < cache(4, result["max_context"] + 1)
  per_token = 56 * KIB  # and by hand: K and V of 4 kv heads x 128 dims x 2 bytes, 28 layers
  assert result["max_batch"] == free // (8192 * per_token) == 137
  assert result["max_context"] == free // (4 * per_token)
  # Smaller kv-head counts never fit less.
  batches = [row["max_batch"] for row in result["variants"]]
  assert batches == sorted(batches) and batches[0] < batches[-1]
  paged = plan(arch, context=8192, batch=4, device_memory=memory, layout="paged", page_size=64)
  paged_cache = lambda batch, context: kinds.cache_bytes(arch.config, CacheConfig("paged", "bf16", 64), batch, context)
  assert paged_cache(paged["max_batch"], 8192) <= free < paged_cache(paged["max_batch"] + 1, 8192)
  assert paged_cache(4, paged["max_context"]) <= free < paged_cache(4, paged["max_context"] + 1)
  assert paged["max_context"] % 64 == 0  # a row holds whole pages


def test_tensor_parallel_splits_kv_heads_as_kvjax_shards_them():
  result = plan(PRESETS["Llama-3-70B"], context=8192, batch=1, device_memory=parse_bytes("80GB"), devices=8)
  by_heads = {row["kv_heads"]: row["max_batch"] for row in result["variants"]}
  # kvjax's sharding splits the cache's kv heads over the model axis when they divide and
  # replicates it whole otherwise: 8 heads put one on each of 8 devices, 16 two; 4 and 2 heads do
  # not divide, so each device holds all of them. On one device the weights alone do not fit.
  assert by_heads[8] == by_heads[1] > by_heads[16] == by_heads[2] > by_heads[4] > 0
  one_head = kv_size.kv_variant(PRESETS["Llama-3-70B"].config, 1)
  assert by_heads[8] == kv_size.max_batch(one_head, CacheConfig(dtype="bf16"), 8192, result["free_bytes_per_device"])
  assert plan(PRESETS["Llama-3-70B"], context=1, batch=1, device_memory=parse_bytes("80GB"))["max_batch"] == 0
  # An MLA cache is not split: each device holds all of it.
  mla = plan(
    PRESETS["Llama-3-70B"], context=8192, batch=1, device_memory=parse_bytes("80GB"), devices=8, mla=((512, 64),)
  )["variants"][0]
  full = kinds.cache_bytes(
    kv_size.mla_variant(PRESETS["Llama-3-70B"].config, 512, 64), CacheConfig(dtype="bf16"), mla["max_batch"], 8192
  )
  assert full <= result["free_bytes_per_device"] and mla["max_batch"] > 0


def test_mla_variants():
  gpt2 = PRESETS["GPT-2"].config  # learned positions, 12 kv heads of 64 dims
  variant = kv_size.mla_variant(gpt2, 512, 64)
  assert (variant.kv_latent_rank, variant.rope_dims, variant.positions) == (512, 64, "rope")
  assert variant.num_kv_heads == 1  # 64 rotary dims do not split into 12 groups; one group of 64 does
  qwen = kv_size.mla_variant(PRESETS["Qwen2-7B"].config, 512, 64)
  assert qwen.num_kv_heads == 4 and qwen.rope_group_dims == 16  # the model's kv heads, where they split it
  assert kv_size.mla_variant(PRESETS["Qwen2-7B"].config, 512, 0).positions == "learned"
  # Quantized latent caches: values and float32 scales of the latent and the rotary key.
  row = plan(PRESETS["Qwen2-7B"], context=1, batch=1, dtype="int8", mla=((512, 64),))["variants"][0]
  assert row["variant"] == "MLA 512+64" and row["bytes_per_token"] == 28 * (512 + 4 + 64 + 4)
  row = plan(PRESETS["Qwen2-7B"], context=1, batch=1, dtype="int4", mla=((512, 64),))["variants"][0]
  assert row["bytes_per_token"] == 28 * (256 + 2 * 4 * 16 + 32 + 2 * 4 * 2)
  for mla, message in (
    ((5000, 64), "no MLA variant 5000\\+64 of this model: ModelConfig.kv_latent_rank=5000"),
    ((512, 63), "no MLA variant 512\\+63 of this model: ModelConfig.rope_dims=63"),
    ((0, 64), "MLA latent rank must be a positive integer"),
    ((512, -2), "MLA rope dims must be a non-negative integer"),
  ):
    with pytest.raises(ValueError, match=message):
      plan(PRESETS["GPT-2"], context=1, batch=1, mla=(mla,))
  with pytest.raises(ValueError, match="int4 cache packs two values per byte.*latent is 21 wide"):
    plan(PRESETS["Qwen2-7B"], context=1, batch=1, dtype="int4", mla=((21, 64),))


def test_models_from_config_file_workdir_and_hf_dir(tmp_path):
  config = ModelConfig(vocab_size=96, d_model=64, num_layers=2, num_heads=8, num_kv_heads=2)
  (tmp_path / "cfg.py").write_text(
    "import types\nfrom kvjax.config import ModelConfig\n"
    f"def get_config():\n  return types.SimpleNamespace(job='train', model=ModelConfig(**{config.to_dict()!r}))\n"
  )
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps({"job": "train", "model": config.to_dict()}))
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(
    json.dumps(
      dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=config.mlp_dim,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
      )
    )
  )
  for spec in (tmp_path / "cfg.py", workdir, hf_dir):
    arch = resolve(str(spec))
    # 2 layers x K and V x 2 kv heads x head dim 8 x 4 bytes.
    assert plan(arch, context=1, batch=1, dtype="fp32")["bytes_per_token"] == 2 * 2 * 2 * 8 * 4
  assert resolve(str(tmp_path / "cfg.py")).config == resolve(str(workdir)).config == config
  leaves = lambda c: sum(x.size for x in jax.tree.leaves(abstract_params(c)))
  assert resolve(str(workdir)).params == leaves(config)
  assert resolve(str(hf_dir)).params == leaves(config.replace(qkv_bias=True))


def test_a_params_checkpoint_names_its_model_in_config_json(tmp_path):
  config = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2)
  params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(config))
  workdir = tmp_path / "imported"
  checkpoint.save_params(workdir, params, config)
  assert resolve(str(workdir)) == architectures.from_model_config("imported", config)
  (workdir / "config.json").unlink()
  with pytest.raises(ValueError, match="holds checkpoints but no config.json"):
    resolve(str(workdir))


def test_text_output_and_errors(capsys, tmp_path):
  out = run_cli("qwen2-7b", "--context", "1024", "--batch", "2", "--device-memory", "24GiB", capsys=capsys)
  assert "* GQA" in out and "56.0 KiB" in out and "max batch" in out
  out = run_cli("gemma-2-9b", "--layout", "paged", "--page-size", "32", capsys=capsys)
  assert "32-token pages" in out and "a paged cache keeps every position" in out
  with pytest.raises(ValueError, match="Qwen2-7B"):
    resolve("no-such-model")
  for text in ("80 gigs", "1e400", "1.2.3GB"):
    with pytest.raises(ValueError, match=f"cannot read memory size '{text}'"):
      parse_bytes(text)
  assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("1.5e9") == 1_500_000_000 and parse_bytes(".5kb") == 500
  with pytest.raises(ValueError, match="context must be a positive integer"):
    plan(PRESETS["GPT-2"], context=0, batch=1)
  with pytest.raises(ValueError, match="dtype 'fp4'"):
    plan(PRESETS["GPT-2"], context=1, batch=1, dtype="fp4")
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
  with pytest.raises(ValueError, match="'bert'"):
    resolve(str(tmp_path))
  # A user's mistake is one line on stderr and exit status 2.
  for argv, message in (
    (["no-such-model"], "unknown model 'no-such-model'"),
    (["gpt-2", "--dtype", "fp4"], "dtype 'fp4' is not one of"),
    (["gpt-2", "--mla", "512:63"], "no MLA variant 512+63 of this model"),
    (["gpt-2", "--layout", "rows"], "CacheConfig.layout must be one of"),
    (["gpt-2", "--page-size", "0"], "argument --page-size: must be a positive integer"),
    (["gpt-2", "--device-memory", "lots"], "cannot read memory size 'lots'"),
  ):
    try:
      status = cli.main(["kv-size", *argv])
    except SystemExit as exit_:  # argparse's refusal of an argument's value
      status = exit_.code
    assert status == 2, argv
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()  # argparse's usage lines may come first
    assert not captured.out and sum("error:" in line for line in lines) == 1, captured.err
    assert lines[-1].startswith("kvjax kv-size: error: ") and message in lines[-1], captured.err


def test_windowed_layers_stop_growing_at_window_plus_sinks():
  config = KV.replace(**WINDOWED)
  arch = architectures.from_model_config("windowed", config)
  fp32 = CacheConfig(dtype="float32")
  per_position = 2 * 2 * 8 * 4  # K and V, 2 kv heads, head dim 8, float32: one layer, one position
  # One global layer grows; the two windowed ones hold 6 positions each from context 6 on (and
  # the lengths take 4 bytes a row).
  assert kinds.cache_bytes(config, fp32, 2, 100) == 2 * per_position * (100 + 12) + 8
  free = kinds.cache_bytes(config, fp32, 2, 100)
  assert kv_size.max_context(config, fp32, 2, free) == 100
  every = config.replace(window=(4,))
  assert kv_size.growth_bound(every, fp32) == 6 and kv_size.growth_bound(config, fp32) is None
  assert kv_size.max_context(every, fp32, 2, free) is None
  assert kv_size.max_context(every, fp32, 2, 2 * 3 * per_position * 5 + 8) == 5
  # A paged cache keeps every position of a windowed layer: it never stops growing.
  assert kv_size.growth_bound(every, CacheConfig("paged", "float32")) is None
  pool = lambda pages: (1 + 2 * pages) * 4 * 3 * per_position + 4 * 2 * (pages + 1)  # + null page, tables, lengths
  assert pool(8) <= free < pool(9)
  assert kv_size.max_context(every, CacheConfig("paged", "float32", 4), 2, free) == 8 * 4
  # An MLA variant (latent 20 + rotary 4 per position) keeps the same positions per layer, in any codec.
  latent = 24 * 4
  latent_row = plan(
    arch, context=20, batch=2, dtype="fp32", device_memory=2 * latent * (200 + 12) + 8 + arch.params * 4, mla=((20, 4),)
  )["variants"][0]
  assert latent_row["variant"] == "MLA 20+4" and latent_row["bytes_per_token"] == 3 * latent
  assert latent_row["cache_bytes"] == 2 * latent * (20 + 6 + 6) + 8
  assert latent_row["max_context"] == 200
  int8_row = plan(arch, context=20, batch=2, dtype="int8", mla=((20, 4),))["variants"][0]
  assert int8_row["bytes_per_token"] == 3 * (20 + 4 + 4 + 4)
  result = plan(PRESETS["Gemma-2-9B"], context=32768, batch=1, device_memory=parse_bytes("80GB"))
  full = result["bytes_per_token"] * 32768
  assert result["cache_bytes"] == full // 2 + full // 2 // 32768 * 4096 + 4  # 21 local layers keep 4096
  mistral = plan(PRESETS["Mistral-7B-v0.1"], context=10**6, batch=1, device_memory=parse_bytes("24GB"))
  assert mistral["max_context"] is None and mistral["cache_bytes"] == 128 * 2**10 * 4096 + 4
  paged = plan(PRESETS["Mistral-7B-v0.1"], context=10**6, batch=1, device_memory=parse_bytes("24GB"), layout="paged")
  assert paged["cache_bytes"] > 128 * 2**10 * 10**6 and paged["max_context"] is not None


def test_named_pretrained_model_from_its_gguf_metadata():
  arch = resolve("smollm2-135m")  # the metadata alone: no tensor is read
  config = arch.config
  assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
  assert plan(arch, context=1, batch=1, dtype="bfloat16")["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
  assert arch.params == param_count(config)
