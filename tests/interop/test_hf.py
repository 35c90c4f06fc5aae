"""Hugging Face import: parity with `transformers` on small random models, and clear errors.

The parity tests build random Llama / Qwen2 / GPT-2 models with transformers, save them
with safetensors (one of them sharded), import them with kvjax.interop.importer.from_hf and compare the
full forward logits, cached prefill + decode logits, and greedy generations.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from kvjax import Transformer, decode_step, generate, prefill
from kvjax.interop.hf_files import load_tokenizer
from kvjax.interop.importer import flatten, from_hf
from conftest import tiered

VOCAB = 128
PROMPT_LENGTHS = (7, 4)
NEW_TOKENS = 6


def _transformers():
  return pytest.importorskip("transformers", reason="parity needs transformers + torch (pip install kvjax[bench])")


def _case(name: str):
  """(model class name, config) for each parity case; all with vocab 128 and 2 layers."""
  tf = _transformers()
  common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.3)
  if name == "llama_gqa_14_2":
    return "LlamaForCausalLM", tf.LlamaConfig(
      hidden_size=56,
      intermediate_size=72,
      num_hidden_layers=2,
      num_attention_heads=14,
      num_key_value_heads=2,
      head_dim=4,
      max_position_embeddings=64,
      rms_norm_eps=1e-5,
      rope_theta=500.0,
      **common,
    )
  if name == "llama_bias_tied":
    return "LlamaForCausalLM", tf.LlamaConfig(
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=4,
      max_position_embeddings=32,
      attention_bias=True,
      tie_word_embeddings=True,
      **common,
    )
  if name == "qwen2_gqa_6_2":
    return "Qwen2ForCausalLM", tf.Qwen2Config(
      hidden_size=48,
      intermediate_size=96,
      num_hidden_layers=2,
      num_attention_heads=6,
      num_key_value_heads=2,
      max_position_embeddings=64,
      tie_word_embeddings=True,
      **common,
    )
  return "GPT2LMHeadModel", tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)


def _save_random(name: str, path, shard: bool = False):
  import torch

  tf = _transformers()
  cls, config = _case(name)
  torch.manual_seed(0)
  model = getattr(tf, cls)(config).eval()
  with torch.no_grad():
    # Norm scales start at one and biases at zero; move them so a dropped one shows.
    for p in model.parameters():
      if p.dim() == 1:
        p.add_(0.2 * torch.randn_like(p))
  model.generation_config.eos_token_id = None
  model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB" if shard else "1GB")
  return model


@pytest.mark.parametrize(
  "name", tiered(["llama_gqa_14_2", "llama_bias_tied", "qwen2_gqa_6_2", "gpt2"], ("llama_gqa_14_2", "gpt2"))
)
def test_parity_with_transformers(name, tmp_path):
  import torch

  shard = name == "llama_gqa_14_2"
  hf_model = _save_random(name, tmp_path, shard=shard)
  if shard:
    assert (tmp_path / "model.safetensors.index.json").is_file()
  params, cfg = from_hf(tmp_path)
  hf_cfg = hf_model.config
  assert cfg.num_heads == hf_cfg.num_attention_heads
  assert cfg.num_kv_heads == getattr(hf_cfg, "num_key_value_heads", hf_cfg.num_attention_heads)
  assert cfg.tie_embeddings == hf_cfg.tie_word_embeddings
  model = Transformer(cfg)

  rng = np.random.default_rng(1)
  prompts = np.zeros((len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)), np.int32)
  for row, n in enumerate(PROMPT_LENGTHS):
    prompts[row, :n] = rng.integers(0, VOCAB, n)
  # transformers' reference, one unpadded row at a time: greedy tokens and full-sequence logits.
  hf_tokens, hf_logits = [], []
  with torch.no_grad():
    for row, n in enumerate(PROMPT_LENGTHS):
      ids = torch.tensor(prompts[row : row + 1, :n], dtype=torch.long)
      out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
      )
      hf_tokens.append(out[0, n:].numpy())
      hf_logits.append(hf_model(out).logits[0].numpy())  # [n + NEW_TOKENS, V]
  hf_tokens = np.stack(hf_tokens)
  assert len(set(hf_tokens.ravel().tolist())) > 2, "reference generation is degenerate"

  # Full forward, no cache.
  n0 = PROMPT_LENGTHS[0]
  full = np.concatenate([prompts[:1, :n0], hf_tokens[:1]], axis=1)
  ours = np.asarray(model.apply({"params": params}, full))[0]
  np.testing.assert_allclose(ours, hf_logits[0], atol=1e-4, rtol=0)

  # Cached: right-padded prefill, then decode fed with the reference tokens.
  lengths = np.array(PROMPT_LENGTHS, np.int32)
  logits, cache = prefill(model, params, prompts, lengths, max_len=32)
  logits = np.asarray(logits)
  for row, n in enumerate(PROMPT_LENGTHS):
    np.testing.assert_allclose(logits[row, :n], hf_logits[row][:n], atol=1e-4, rtol=0)
  for step in range(NEW_TOKENS - 1):
    step_logits, cache = decode_step(model, params, cache, hf_tokens[:, step])
    for row, n in enumerate(PROMPT_LENGTHS):
      np.testing.assert_allclose(np.asarray(step_logits)[row], hf_logits[row][n + step], atol=1e-4, rtol=0)

  ours_tokens = np.asarray(generate(model, params, prompts, lengths, NEW_TOKENS))
  np.testing.assert_array_equal(ours_tokens, hf_tokens)


def test_bfloat16_checkpoint_is_read_exactly(tmp_path):
  import torch

  hf_model = _save_random("qwen2_gqa_6_2", tmp_path)
  hf_model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
  params, cfg = from_hf(tmp_path)
  assert cfg.dtype == "bfloat16"
  q_proj = hf_model.model.layers[1].self_attn.q_proj
  want = q_proj.weight.detach().float().numpy().T.reshape(48, 6, 8)
  np.testing.assert_array_equal(params["layers_1"]["attn"]["q"]["kernel"], want)
  np.testing.assert_array_equal(
    params["layers_1"]["attn"]["q"]["bias"], q_proj.bias.detach().float().numpy().reshape(6, 8)
  )
  assert from_hf(tmp_path, dtype="float32")[1].dtype == "float32"


def _tiny_llama(path, **overrides):
  """A hand-written 1-layer Llama directory (no transformers needed)."""
  config = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=16,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
  )
  config.update(overrides)
  path.mkdir(exist_ok=True)
  (path / "config.json").write_text(json.dumps(config))
  rng = np.random.default_rng(0)
  shapes = {
    "model.embed_tokens.weight": (16, 8),
    "model.norm.weight": (8,),
    "lm_head.weight": (16, 8),
    "model.layers.0.input_layernorm.weight": (8,),
    "model.layers.0.post_attention_layernorm.weight": (8,),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.self_attn.k_proj.weight": (4, 8),
    "model.layers.0.self_attn.v_proj.weight": (4, 8),
    "model.layers.0.self_attn.o_proj.weight": (8, 8),
    "model.layers.0.mlp.gate_proj.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (16, 8),
    "model.layers.0.mlp.down_proj.weight": (8, 16),
  }
  tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  save_file(tensors, str(path / "model.safetensors"))
  return tensors


def test_hand_written_llama_maps_layouts(tmp_path):
  tensors = _tiny_llama(tmp_path)
  params, cfg = from_hf(tmp_path)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim) == (2, 1, 4, 16)
  q = tensors["model.layers.0.self_attn.q_proj.weight"]  # [N*H, D]
  # Query head n, dim h reads HF row n * H + h.
  np.testing.assert_array_equal(params["layers_0"]["attn"]["q"]["kernel"][:, 1, 2], q[1 * 4 + 2])
  o = tensors["model.layers.0.self_attn.o_proj.weight"]  # [D, N*H]
  np.testing.assert_array_equal(params["layers_0"]["attn"]["out"]["kernel"][1, 2], o[:, 1 * 4 + 2])
  np.testing.assert_array_equal(params["lm_head"]["kernel"], tensors["lm_head.weight"].T)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), "'gemma'"),
    (dict(model_type="mistral", sliding_window=4), "sliding_window=4"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "'llama3' lacks"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "'yarn'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(num_hidden_layers=2), "layers.1.input_layernorm.weight"),
    (dict(attention_bias=True), "self_attn.q_proj.bias"),
    (dict(num_key_value_heads=2), "self_attn.k_proj.weight"),
  ],
)
def test_unsupported_or_inconsistent_checkpoint_is_named(tmp_path, overrides, message):
  _tiny_llama(tmp_path, **overrides)
  with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("[", r"\[")):
    from_hf(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
  tensors = _tiny_llama(tmp_path)
  kept = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.up_proj.weight"}
  save_file(kept, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.0\.mlp\.up_proj\.weight"):
    from_hf(tmp_path)
  save_file(
    {**tensors, "model.layers.0.self_attn.o_proj.bias": np.zeros(8, np.float32)}, str(tmp_path / "model.safetensors")
  )
  with pytest.raises(ValueError, match=r"does not account for.*o_proj\.bias"):
    from_hf(tmp_path)


def test_missing_files_are_named(tmp_path):
  with pytest.raises(ValueError, match="config.json does not exist"):
    from_hf(tmp_path)
  _tiny_llama(tmp_path)
  (tmp_path / "model.safetensors").unlink()
  with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
    from_hf(tmp_path)
  index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
    from_hf(tmp_path)


def _word_tokenizer(words):
  """A word-level tokenizer: [UNK] is id 0, then `words` in order."""
  tokenizers = pytest.importorskip("tokenizers", reason="needs the tokenizers package")
  vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  return tok


def test_tokenizer_json_is_loaded(tmp_path):
  assert load_tokenizer(tmp_path) is None
  _word_tokenizer(["hello", "world"]).save(str(tmp_path / "tokenizer.json"))
  assert load_tokenizer(tmp_path).encode("hello world again").ids == [1, 2, 0]
  assert load_tokenizer(tmp_path, vocab_size=3) is not None
  with pytest.raises(ValueError, match=r"tokenizer\.json has token ids up to 2, past the model's vocab_size=2"):
    load_tokenizer(tmp_path, vocab_size=2)


def test_import_hf_writes_a_loadable_checkpoint(tmp_path, capsys):
  from kvjax.cli import main as cli
  from kvjax.conversion.import_model import import_model
  from kvjax.training.checkpoint import load_model

  hf_dir, workdir = tmp_path / "hf", tmp_path / "run"
  _tiny_llama(hf_dir)
  _word_tokenizer(["hello", "world"]).save(str(hf_dir / "tokenizer.json"))
  assert cli.main(["import-hf", str(hf_dir), "--workdir", str(workdir)]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["tokenizer"] == str(workdir / "tokenizer.json") and (workdir / "tokenizer.json").is_file()
  model, params, _ = load_model(workdir)
  want, cfg = from_hf(hf_dir)
  assert model.config == cfg and summary["model"] == cfg.to_dict()
  flat_want = dict(flatten(want))
  flat_got = dict(flatten(params))
  assert flat_got.keys() == flat_want.keys()
  for key, value in flat_want.items():
    np.testing.assert_array_equal(np.asarray(flat_got[key]), value)
  with pytest.raises(ValueError, match="already holds checkpoints"):
    import_model(hf_dir, workdir)


def test_imported_gpt2_converts_to_gqa_and_uptrains(tmp_path):
  import torch

  from kvjax.training.checkpoint import load_model
  from kvjax.conversion.conversions import KVHeads
  from kvjax.conversion.import_model import import_model
  from kvjax.conversion.uptrain import uptrain

  tf = _transformers()
  torch.manual_seed(0)
  config = tf.GPT2Config(
    vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None
  )
  tf.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf", safe_serialization=True)
  import_model(tmp_path / "hf", tmp_path / "imported")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
  record = uptrain(
    tmp_path / "imported",
    tmp_path / "gqa",
    KVHeads(2, "mean"),
    overrides=[
      f"data.source={corpus}",
      "data.seq_len=32",
      "train.steps=6",
      "train.batch_size=4",
      "train.lr=3e-3",
      "train.warmup_steps=1",
      "train.eval_batches=2",
    ],
  )
  model, _, _ = load_model(tmp_path / "gqa")
  assert (model.config.num_heads, model.config.num_kv_heads) == (4, 2)
  assert (model.config.positions, model.config.norm, model.config.use_bias) == ("learned", "layernorm", True)
  assert record["after"]["loss"] < record["converted"]["loss"]


def _flat_params(params) -> dict:
  return {k: np.asarray(v) for k, v in flatten(params).items()}


def _assert_same_params(got, want):
  got, want = _flat_params(got), _flat_params(want)
  assert got.keys() == want.keys()
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg="/".join(key))


def _shape(path, name):
  with safe_open(path, framework="numpy") as st:
    return tuple(st.get_slice(name).get_shape())


def test_stray_safetensors_beside_a_single_file_model_is_ignored(tmp_path):
  _save_random("llama_bias_tied", tmp_path)
  want, _ = from_hf(tmp_path)
  # Were it read, the first would replace the final norm's scale; the second is not even safetensors.
  save_file({"model.norm.weight": np.full(32, 7.0, np.float32)}, str(tmp_path / "extra.safetensors"))
  (tmp_path / "notes.safetensors").write_text("not a tensor file")
  got, _ = from_hf(tmp_path)
  _assert_same_params(got, want)


def test_sharded_checkpoint_reads_exactly_what_its_index_declares(tmp_path):
  _save_random("llama_gqa_14_2", tmp_path, shard=True)
  index_path = tmp_path / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2
  want, _ = from_hf(tmp_path)
  held = {f: sorted(n for n, g in index["weight_map"].items() if g == f) for f in shards}
  shard = next(f for f in shards if len(held[f]) > 1)  # still declared when one tensor moves away
  other = next(f for f in shards if f != shard)
  name = held[shard][0]
  # A stray single file beside the index, holding one of its tensors, is not read.
  save_file({name: np.zeros(_shape(tmp_path / shard, name), np.float32)}, str(tmp_path / "model.safetensors"))
  _assert_same_params(from_hf(tmp_path)[0], want)

  def refused(weight_map, message):
    index_path.write_text(json.dumps({**index, "weight_map": weight_map}))
    with pytest.raises(ValueError, match=message):
      from_hf(tmp_path)

  # The index places a tensor in a shard that does not hold it.
  refused(
    {**index["weight_map"], name: other},
    rf"places tensor {re.escape(name)} in {other}, which does not hold it \(it is in {shard}\)",
  )
  # A shard holds a tensor the index does not place there.
  refused(
    {k: v for k, v in index["weight_map"].items() if k != name},
    rf"{shard} holds 1 tensor\(s\) that model.safetensors.index.json does not place there: \['{re.escape(name)}'\]",
  )
  refused({**index["weight_map"], name: f"../{shard}"}, "which is not a file in")
  # A declared shard that is missing.
  index_path.write_text(json.dumps(index))
  (tmp_path / other).unlink()
  with pytest.raises(ValueError, match=rf"lists shard files that do not exist: \['{other}'\]"):
    from_hf(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "header", "empty", "truncated shard"])
def test_damaged_safetensors_file_is_refused_naming_it(tmp_path, damage):
  _save_random(
    "qwen2_gqa_6_2" if damage != "truncated shard" else "llama_gqa_14_2", tmp_path, shard=damage == "truncated shard"
  )
  if damage == "truncated shard":
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    path = tmp_path / sorted(set(index["weight_map"].values()))[1]
  else:
    path = tmp_path / "model.safetensors"
  data = path.read_bytes()
  header = int.from_bytes(data[:8], "little")
  damaged = {
    "truncated": data[: len(data) - 100],
    "truncated shard": data[: len(data) - 100],
    "header": data[:8] + b"x" * header + data[8 + header :],
    "empty": b"",
  }[damage]
  path.write_bytes(damaged)
  with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} is not a readable safetensors file"):
    from_hf(tmp_path)


def test_tensor_of_the_wrong_dtype_or_shape_is_named_with_its_file(tmp_path):
  tensors = _tiny_llama(tmp_path)
  path = tmp_path / "model.safetensors"
  save_file({**tensors, "model.norm.weight": np.arange(8, dtype=np.int32)}, str(path))
  with pytest.raises(ValueError, match=rf"tensor model\.norm\.weight in {re.escape(str(path))} has dtype I32"):
    from_hf(tmp_path)
  save_file({**tensors, "model.layers.0.self_attn.k_proj.weight": np.zeros((5, 8), np.float32)}, str(path))
  with pytest.raises(
    ValueError,
    match=rf"tensor layers\.0\.self_attn\.k_proj\.weight of shape \(5, 8\) in "
    rf"{re.escape(str(path))} does not fit kvjax parameter layers_0/attn/k/kernel",
  ):
    from_hf(tmp_path)


@pytest.mark.parametrize(
  "tokenizer, message",
  [
    ('{"version": "1.0"}', "is not a valid tokenizer.json"),
    ("{not json", "is not a valid tokenizer.json"),
    ([f"w{i}" for i in range(20)], r"has token ids up to 20, past the model's vocab_size=16"),
  ],
  ids=["no_model", "not_json", "ids_past_vocab"],
)
def test_bad_tokenizer_json_is_refused_at_import(tmp_path, tokenizer, message):
  from kvjax.conversion.import_model import import_model

  hf_dir, workdir = tmp_path / "hf", tmp_path / "run"
  _tiny_llama(hf_dir)  # vocab_size 16
  path = hf_dir / "tokenizer.json"
  if isinstance(tokenizer, str):
    path.write_text(tokenizer)
  else:
    _word_tokenizer(tokenizer).save(str(path))
  with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} {message}"):
    import_model(hf_dir, workdir)
  assert not workdir.exists()


def test_tokenizer_travels_to_the_uptrained_workdir_and_is_used(tmp_path):
  import jax
  import torch

  from kvjax.cli.generate import continue_text
  from kvjax.conversion.conversions import KVHeads
  from kvjax.conversion.import_model import import_model
  from kvjax.conversion.uptrain import uptrain
  from kvjax.training.checkpoint import load_model
  from kvjax.training.evaluate import evaluate_checkpoint

  tf = _transformers()
  torch.manual_seed(0)
  config = tf.GPT2Config(
    vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None
  )
  tf.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf", safe_serialization=True)
  tokenizer = _word_tokenizer("the quick brown fox jumps over lazy dog .".split())
  tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
  import_model(tmp_path / "hf", tmp_path / "imported")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
  record = uptrain(
    tmp_path / "imported",
    tmp_path / "gqa",
    KVHeads(2, "mean"),
    overrides=[
      f"data.source={corpus}",
      "data.seq_len=16",
      "train.steps=4",
      "train.batch_size=4",
      "train.lr=3e-3",
      "train.warmup_steps=1",
      "train.eval_batches=2",
    ],
  )
  copied = tmp_path / "gqa" / "tokenizer.json"
  assert copied.read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
  # Each sentence is 45 bytes in 10 tokens; on byte ids, loss / bits per byte would be ln 2 exactly.
  # "after" is the training run's own evaluation, so training read token ids too.
  for quality in (record["before"], record["converted"], record["after"]):
    assert quality["loss"] / (quality["bits_per_byte"] * math.log(2)) == pytest.approx(4.5, rel=0.05)
  assert evaluate_checkpoint(tmp_path / "gqa")["loss"] == pytest.approx(record["after"]["loss"], rel=1e-5)
  model, params, _ = load_model(tmp_path / "gqa")
  prompt = np.array([tokenizer.encode("the quick").ids], np.int32)  # [[1, 2]]
  ids = generate(model, params, prompt, [2], 6, rng=jax.random.key(0))
  assert continue_text(tmp_path / "gqa", "the quick", max_new_tokens=6) == tokenizer.decode(np.asarray(ids[0]).tolist())
