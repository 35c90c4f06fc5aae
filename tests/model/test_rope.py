"""RoPE (kvjax.model.rope) and Llama 3's frequency scaling: the frequencies equal transformers'
inv_freq; a random Llama with rope_type "llama3" imports, runs and exports with transformers'
logits (and would not without the scaling); RopeScaling's checks and its saved form."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvjax
from kvjax.config import RopeScaling
from kvjax.fields import apply_overrides, from_dict, to_dict
from kvjax.interop.importer import config_from_hf, from_hf
from kvjax.interop.hf_export import export_hf
from kvjax.model.mla import rope_frequencies
from kvjax.model.rope import frequencies
from conftest import init_params, tiny_config

transformers = pytest.importorskip(
  "transformers", reason="parity needs transformers + torch (pip install kvjax[bench])"
)
torch = pytest.importorskip("torch")

VOCAB, TOKENS = 96, 48
# Llama 3's factors over a short "pretraining" context, so that at TOKENS positions the scaling
# matters: with head_dim 16 and theta 1e4, the wavelengths 2 pi, 19.9, 62.8, ... fall in all three
# regimes (under 32 / 4 kept, between blended, over 32 / 1 slowed by 8).
LLAMA3 = dict(
  rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)
SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=32)


def hf_llama(rope_parameters: dict, head_dim: int = 16, theta: float = 1e4, **changes):
  base = dict(
    vocab_size=VOCAB,
    hidden_size=4 * head_dim,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=head_dim,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_parameters={**rope_parameters, "rope_theta": theta},
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
  )
  return transformers.LlamaConfig(**{**base, **changes})


@pytest.mark.parametrize(
  "theta, dims, factor, low, high, original",
  [
    (5e5, 128, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
    (5e5, 64, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B
    (1e4, 16, 8.0, 1.0, 4.0, 32),
    (1e4, 16, 4.0, 2.0, 3.0, 150),
  ],
)
def test_llama3_frequencies_equal_transformers_inv_freq(theta, dims, factor, low, high, original):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  params = dict(
    rope_type="llama3",
    factor=factor,
    low_freq_factor=low,
    high_freq_factor=high,
    original_max_position_embeddings=original,
  )
  inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](
    hf_llama(params, head_dim=dims, theta=theta, max_position_embeddings=2 * original), "cpu"
  )
  scaling = RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_position=original)
  ours = frequencies(theta, dims, scaling)
  assert ours.dtype == np.float32 and ours.shape == (dims // 2,)
  np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=2e-6, atol=0)
  plain = frequencies(theta, dims)
  np.testing.assert_allclose(plain, theta ** (-np.arange(dims // 2) / (dims // 2)), rtol=1e-6)
  # Each setting keeps some pairs, slows some by the whole factor and blends at least one.
  ratio = ours / plain
  assert np.isclose(ratio, 1).any() and np.isclose(ratio, 1 / factor).any()
  assert ((ratio < 0.999) & (ratio > 1.001 / factor)).any()


def test_frequencies_refuse_an_odd_width():
  with pytest.raises(ValueError, match="dims=7"):
    frequencies(1e4, 7)


def _save_random_llama(path, rope_parameters: dict):
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(hf_llama(rope_parameters)).eval()
  with torch.no_grad():
    for p in model.parameters():  # norm scales start at one; move them so a dropped one shows
      if p.dim() == 1:
        p.add_(0.2 * torch.randn_like(p))
  model.save_pretrained(path, safe_serialization=True)
  return model


def test_llama3_scaled_llama_matches_transformers(tmp_path):
  hf_model = _save_random_llama(tmp_path, LLAMA3)
  params, cfg = from_hf(tmp_path)
  assert cfg.rope_scaling == SCALING and cfg.rope_theta == 1e4
  tokens = np.random.default_rng(1).integers(0, VOCAB, (1, TOKENS)).astype(np.int32)
  with torch.no_grad():
    want = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()  # [1, T, V]
  model = kvjax.Transformer(cfg)
  np.testing.assert_allclose(np.asarray(model.apply({"params": params}, tokens)), want, atol=1e-4, rtol=0)
  # Ignoring the scaling would be caught: plain RoPE is far off at these positions.
  plain = np.asarray(kvjax.Transformer(cfg.replace(rope_scaling=None)).apply({"params": params}, tokens))
  assert np.abs(plain - want).max() > 1e-2
  # The cached path rotates alike: prefill then decode from the cache.
  prompt = TOKENS - 4
  logits, cache = kvjax.prefill(model, params, tokens[:, :prompt], np.array([prompt], np.int32), max_len=TOKENS)
  np.testing.assert_allclose(np.asarray(logits)[0], want[0, :prompt], atol=1e-4, rtol=0)
  for t in range(prompt, TOKENS):
    step, cache = kvjax.decode_step(model, params, cache, tokens[:, t])
    np.testing.assert_allclose(np.asarray(step)[0], want[0, t], atol=1e-4, rtol=0)


def test_transformers_4_layout_reads_the_same(tmp_path):
  """rope_scaling beside a top-level rope_theta (transformers 4) and rope_parameters (5) agree."""
  hf = hf_llama(LLAMA3).to_dict()
  v5 = config_from_hf(hf)
  v4 = {k: v for k, v in hf.items() if k != "rope_parameters"}
  v4.update(rope_theta=1e4, rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}})
  assert config_from_hf(v4) == v5 and v5.rope_scaling == SCALING
  # transformers' fallbacks for the pretraining context: a top-level entry first, then max_position_embeddings.
  no_original = {k: v for k, v in v4["rope_scaling"].items() if k != "original_max_position_embeddings"}
  assert config_from_hf({**v4, "rope_scaling": no_original}).rope_scaling.original_max_position == 64
  top = {**v4, "original_max_position_embeddings": 24}
  assert config_from_hf(top).rope_scaling.original_max_position == 24


@pytest.mark.parametrize(
  "rope, message",
  [
    (dict(rope_type="yarn", factor=4.0), "rope_parameters of type 'yarn' is not supported"),
    (dict(rope_type="linear", factor=4.0), "'linear'"),
    (dict(rope_type="llama3", factor=8.0), r"'llama3' lacks \['low_freq_factor', 'high_freq_factor'\]"),
    ({**LLAMA3, "high_freq_factor": 1.0}, r"config.json rope_parameters: RopeScaling.high_freq_factor=1.0"),
  ],
)
def test_importer_refuses_other_rope_types_by_name(rope, message):
  hf = hf_llama({}).to_dict()
  hf["rope_parameters"] = {**rope, "rope_theta": 1e4}
  with pytest.raises(ValueError, match=message):
    config_from_hf(hf)


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(kind="yarn"), r"RopeScaling.kind must be one of \('llama3',\), got 'yarn'"),
    (dict(factor=0.5), r"RopeScaling.factor must be .* got 0.5"),
    (dict(factor=float("nan")), r"RopeScaling.factor must be"),
    (dict(low_freq_factor=0), r"RopeScaling.low_freq_factor must be .* got 0"),
    (dict(high_freq_factor=1.0), r"RopeScaling.high_freq_factor=1.0 must be larger than low_freq_factor=1.0"),
    (dict(original_max_position=0), r"RopeScaling.original_max_position must be a positive integer, got 0"),
    (dict(original_max_position=32.0), r"RopeScaling.original_max_position must be a positive integer"),
  ],
)
def test_rope_scaling_checks_name_the_field(changes, message):
  with pytest.raises(ValueError, match=message):
    RopeScaling(**changes)


def test_rope_scaling_needs_rope_positions():
  with pytest.raises(ValueError, match=r"ModelConfig.rope_scaling=.* positions='learned'; use rope_scaling=None"):
    tiny_config(positions="learned", rope_scaling=SCALING)
  with pytest.raises(ValueError, match=r"ModelConfig.rope_scaling must be a RopeScaling or None"):
    tiny_config(rope_scaling={"factor": 8.0})


def test_rope_scaling_round_trips():
  plain = tiny_config()
  assert to_dict(plain)["rope_scaling"] is None
  assert from_dict(kvjax.ModelConfig, to_dict(plain)) == plain
  scaled = tiny_config(rope_scaling=RopeScaling(factor=8, original_max_position=32))
  saved = json.loads(json.dumps(to_dict(scaled)))
  assert saved["rope_scaling"] == {
    "kind": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position": 32,
  }
  assert from_dict(kvjax.ModelConfig, saved) == scaled
  with pytest.raises(ValueError, match="ModelConfig.rope_scaling"):
    from_dict(kvjax.ModelConfig, {**saved, "rope_scaling": {**saved["rope_scaling"], "factor": 0.5}})
  # Overrides reach the nested fields, or set the whole scaling from a dict.
  assert apply_overrides(scaled, ["rope_scaling.factor=4"]).rope_scaling.factor == 4.0
  assert apply_overrides(plain, ["rope_scaling={'original_max_position': 32}"]).rope_scaling == RopeScaling(
    original_max_position=32
  )


def test_scaled_model_exports_to_transformers(tmp_path):
  cfg = tiny_config(vocab_size=VOCAB, head_dim=16, max_len=64, norm_eps=1e-5, rope_scaling=SCALING)
  _, params = init_params(cfg)
  export_hf(params, cfg, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["rope_parameters"] == {**LLAMA3, "rope_theta": 1e4}
  assert config_from_hf(written) == cfg
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
  tokens = np.random.default_rng(2).integers(0, VOCAB, (1, TOKENS)).astype(np.int32)
  with torch.inference_mode():
    want = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  ours = np.asarray(kvjax.Transformer(cfg).apply({"params": params}, tokens))
  np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)


def test_mla_frequencies_come_from_the_one_function():
  """A converted MLA model's kept pairs turn at the source head's (scaled) frequencies."""
  pairs = ((0, 5, 7, 2), (7, 6, 1, 0))
  cfg = tiny_config(2, head_dim=16, kv_latent_rank=12, rope_dims=8, rope_pairs=pairs, rope_scaling=SCALING)
  source = frequencies(cfg.rope_theta, 16, SCALING)
  for layer in range(2):
    np.testing.assert_array_equal(rope_frequencies(cfg, layer), source[np.reshape(pairs[layer], (2, 2))])
  native = cfg.replace(rope_pairs=None)
  np.testing.assert_array_equal(rope_frequencies(native, 0), np.tile(frequencies(cfg.rope_theta, 4, SCALING), (2, 1)))
