"""Conversions as values: their names, target configs and refusals; convert is the pure function
it names (kv_heads.convert_kv_heads, mla.convert_to_mla), and a conversion reads back from its
dict."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax.cache import kinds
from kvjax.fields import to_dict
from kvjax.conversion.conversions import KVHeads, ToMLA, from_record
from conftest import init_params, tiny_config

CALIBRATION = np.asarray(jax.random.randint(jax.random.key(8), (4, 32), 0, 64))
MHA = tiny_config(4)  # 4 heads of 8 dims, 2 layers, float32


def test_names_labels_and_what_they_need():
  assert [
    (c.name, c.label, c.kind, c.needs_calibration)
    for c in (
      KVHeads(2),
      KVHeads(1, "pca"),
      KVHeads(2, "regroup"),
      KVHeads(2, "random", seed=3),
      ToMLA(32, 8),
      ToMLA(32, 8, "svd"),
    )
  ] == [
    ("kv2_mean", "mean", "heads", False),
    ("kv1_pca", "pca", "heads", True),
    ("kv2_regroup", "regroup", "heads", True),
    ("kv2_random_seed3", "random", "heads", False),
    ("mla_r32_rope8", "32+8", "mla", True),
    ("mla_r32_rope8_svd", "32+8 svd", "mla", True),
  ]
  # The default seed and factorisation are left out of the name, not of the dict.
  assert to_dict(KVHeads(2, "random")) == {"num_kv_heads": 2, "method": "random", "seed": 0}
  assert to_dict(ToMLA(32, 8)) == {"kv_latent_rank": 32, "rope_dims": 8, "factorisation": "activation"}


def test_targets_are_the_converted_shapes():
  assert KVHeads(2).target(MHA) == MHA.replace(num_kv_heads=2)
  assert KVHeads(1).target(tiny_config(2)) == tiny_config(1)
  mla = ToMLA(12, 8).target(MHA)
  assert (mla.kv_latent_rank, mla.rope_dims, mla.num_kv_heads) == (12, 8, 4)
  assert kinds.bytes_per_token(mla) == 2 * (12 + 8) * 4
  # At the KV bytes of a kv-head count: rank + rope_dims = 2 x kv heads x head_dim per layer.
  for kv, rope in ((2, 8), (1, 8)):
    assert kinds.bytes_per_token(ToMLA.at_kv_heads(MHA, kv, rope).target(MHA)) == kinds.bytes_per_token(
      KVHeads(kv).target(MHA)
    )
  assert ToMLA.at_kv_heads(MHA, 2, 8) == ToMLA(24, 8)


def test_convert_is_the_function_it_names():
  _, params = init_params(MHA)
  same = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
  for method, calibration in (("mean", None), ("first", None), ("pca", CALIBRATION), ("regroup", CALIBRATION)):
    converted, config = KVHeads(2, method).convert(params, MHA, calibration)
    want, want_config = kvjax.convert_kv_heads(params, MHA, 2, method, calibration=calibration)
    assert config == want_config == KVHeads(2, method).target(MHA)
    same(converted, want)
  random, _ = KVHeads(1, "random", seed=5).convert(params, MHA)
  same(random, kvjax.convert_kv_heads(params, MHA, 1, "random", rng=jax.random.key(5))[0])
  assert not np.allclose(
    random["layers_0"]["attn"]["k"]["kernel"],
    KVHeads(1, "random").convert(params, MHA)[0]["layers_0"]["attn"]["k"]["kernel"],
  )
  converted, config = ToMLA(12, 8, "svd").convert(params, MHA, CALIBRATION)
  want, want_config = kvjax.convert_to_mla(params, MHA, 12, 8, calibration=CALIBRATION, factorisation="svd")
  same(converted, want)
  assert config == want_config and config.replace(rope_pairs=None) == ToMLA(12, 8).target(MHA)


def test_a_conversion_reads_back_from_its_dict():
  for conversion in (KVHeads(2), KVHeads(1, "random", seed=2), ToMLA(32, 8), ToMLA(16, 0, "svd")):
    assert from_record(to_dict(conversion)) == conversion
  with pytest.raises(
    ValueError,
    match=r"is not a conversion; the keys of each kind are KVHeads: num_kv_heads, "
    r"method, seed; ToMLA: kv_latent_rank, rope_dims, factorisation",
  ):
    from_record({"num_kv_heads": 2, "rope_dims": 8})
  with pytest.raises(ValueError, match="KVHeads.method must be one of"):
    from_record({"num_kv_heads": 2, "method": "median"})


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: KVHeads(0), "KVHeads.num_kv_heads must be a positive integer, got 0"),
    (lambda: KVHeads(2, "median"), r"KVHeads.method must be one of \('mean', 'first', 'random', 'pca', 'regroup'\)"),
    (lambda: KVHeads(2, "mean", seed=1), "KVHeads.seed=1 seeds method='random' only, not method='mean'"),
    (
      lambda: KVHeads(3).target(MHA),
      r"KVHeads.num_kv_heads=3: cannot convert 4 kv heads to 3: the target must "
      r"divide the current number of kv heads \(4\)",
    ),
    (lambda: KVHeads(8).target(MHA), "cannot convert 4 kv heads to 8"),
    (lambda: KVHeads(2).target(MHA.replace(kv_latent_rank=8, rope_dims=8)), r"the model is MLA \(kv_latent_rank=8\)"),
    (lambda: ToMLA(0, 8), "ToMLA.kv_latent_rank must be a positive integer"),
    (lambda: ToMLA(8, -2), "ToMLA.rope_dims must be a non-negative integer, got -2"),
    (lambda: ToMLA(8, 8, "qr"), r"ToMLA.factorisation must be one of \('activation', 'svd'\), got 'qr'"),
    (lambda: ToMLA(65, 8).target(MHA), "kv_latent_rank=65 is larger than possible"),
    (lambda: ToMLA(8, 6).target(MHA), r"rope_dims=6 must be a multiple of 2 x num_kv_heads=8"),
    (lambda: ToMLA(8, 0).target(MHA), "rope_dims must be positive for a RoPE model"),
    (lambda: ToMLA.at_kv_heads(MHA, 1, 16), r"rope_dims=16 leaves no latent at the bytes of 1 kv heads"),
  ],
  ids=lambda x: x if isinstance(x, str) else "",
)
def test_refusals_name_the_field_and_value(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_convert_refuses_what_it_cannot_convert():
  _, params = init_params(MHA)
  with pytest.raises(ValueError, match="method='pca' needs calibration tokens"):
    KVHeads(2, "pca").convert(params, MHA, None)
  with pytest.raises(ValueError, match="needs calibration tokens"):
    ToMLA(12, 8).convert(params, MHA, None)
  with pytest.raises(ValueError, match="cannot convert 4 kv heads to 3"):
    KVHeads(3).convert(params, MHA)
