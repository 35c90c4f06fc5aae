"""Weights stored for decoding (kvjax.model.weights): a stored tree computes what the float32 tree
it stands for computes (up to its activations' rounding to bfloat16) for every layer kind that
holds weights; the decode entry points' CPU kernels compute what XLA does with the same stored
tree; bad formats are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.model import weights
from kvjax.model.backend import Backend
from conftest import init_params, tiered, tiny_config

CONFIGS = {
  "gqa-tied": tiny_config(2, tie_embeddings=True),
  "mqa-bias-untied": tiny_config(1, qkv_bias=True, tie_embeddings=False),
  "gpt2-learned": tiny_config(4, positions="learned", norm="layernorm", activation="gelu", use_bias=True),
  "mla": tiny_config(2, kv_latent_rank=8, rope_dims=4),
}


@pytest.mark.parametrize(
  "name, fmt",
  tiered(
    [(n, f) for f in ("bfloat16", "int8") for n in CONFIGS],
    [("gqa-tied", "bfloat16"), ("mla", "bfloat16"), ("mqa-bias-untied", "int8"), ("gpt2-learned", "int8")],
  ),
)
def test_stored_tree_computes_its_widened_tree(name, fmt):
  model, params = init_params(CONFIGS[name])
  stored = weights.store(params, fmt)
  assert weights.weight_format(stored) == fmt
  assert weights.weight_bytes(stored) < weights.weight_bytes(params)
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, model.config.vocab_size)
  apply = jax.jit(model.apply)  # one compiled forward per tree, not one program per operation
  ours = apply({"params": stored}, tokens)
  widened = apply({"params": weights.widened(stored)}, tokens)
  scale = float(jnp.abs(widened).max())
  np.testing.assert_allclose(ours, widened, atol=0.01 * scale)  # the activations' rounding only
  # and near the float32 model: the weights' rounding moves no logit by 3% of the largest
  np.testing.assert_allclose(ours, apply({"params": params}, tokens), atol=0.03 * scale)


@pytest.mark.parametrize("fmt", tiered(["bfloat16", "int8"], ("int8",)))
def test_decode_entry_points_read_stored_weights(fmt):
  # prefill and decode_step route small products to the CPU kernel, which reads the stored format
  # in place: the logits of XLA's products of the same tree. Each product agrees to float32
  # rounding, but an activation on a bfloat16 rounding boundary may round the other way, so the
  # logits agree to a fraction of a percent, not to float32 precision.
  model, params = init_params(tiny_config(2))
  stored = weights.store(params, fmt)
  xla = model.clone(backend=Backend())  # a backend of its own: the entry points keep it
  prompts = np.asarray(jax.random.randint(jax.random.key(2), (3, 7), 0, 64), np.int32)
  lengths = np.array([7, 4, 5], np.int32)
  for batch in (1, 3):
    logits_s, cache_s = kvjax.prefill(model, stored, prompts[:batch], lengths[:batch], 32, logits="last")
    logits_w, cache_w = kvjax.prefill(xla, stored, prompts[:batch], lengths[:batch], 32, logits="last")
    np.testing.assert_allclose(logits_s, logits_w, atol=0.01 * float(jnp.abs(logits_w).max()))
    token = np.asarray(jnp.argmax(logits_w, -1))
    step_s, _ = kvjax.decode_step(model, stored, cache_s, token)
    step_w, _ = kvjax.decode_step(xla, stored, cache_w, token)
    np.testing.assert_allclose(step_s, step_w, atol=0.01 * float(jnp.abs(step_w).max()))


def test_engine_stores_its_weights():
  model, params = init_params(tiny_config(2))
  prompt = np.arange(1, 9, dtype=np.int32)
  engine = kvjax.Engine(model, params, kvjax.EngineConfig(num_slots=2, num_pages=9, weights="int8"))
  engine.submit(prompt, 5)
  ours = engine.run()[0]
  theirs = kvjax.generate(model, weights.store(params, "int8"), prompt[None], np.array([8]), 5)[0]
  np.testing.assert_array_equal(ours, theirs)


def test_bad_formats_are_refused():
  model, params = init_params(tiny_config(2))
  with pytest.raises(ValueError, match="weight format 'int3' is not one of float32, bfloat16, int8"):
    weights.store(params, "int3")
  with pytest.raises(ValueError, match="stored as int8; store bfloat16 from the float32 ones"):
    weights.store(weights.store(params, "int8"), "bfloat16")
  with pytest.raises(ValueError, match="EngineConfig.weights"):
    kvjax.EngineConfig(weights="int4")
  assert weights.store(params, "float32") is params


def test_round_to_bfloat16_is_round_to_nearest_even():
  from kvjax.numerics import round_to_bfloat16

  rng = np.random.default_rng(0)
  x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 30, 1000), [0.0, -0.0, np.inf, -np.inf]])
  x = x.astype(np.float32)
  np.testing.assert_array_equal(
    np.asarray(round_to_bfloat16(jnp.asarray(x))), x.astype(jnp.bfloat16).astype(np.float32)
  )
