"""Sampling filters against hand-computed answers, and their settings' validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.decoding.sampling import Sampling, filter_logits, sample

LOGITS = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))


@pytest.mark.parametrize(
  "top_k,top_p,kept",
  [
    (0, 1.0, [0, 1, 2, 3, 4]),
    (2, 1.0, [0, 1]),
    (0, 0.5, [0]),  # the top token alone holds 0.5 of the mass
    (0, 0.6, [0, 1]),
    (0, 0.86, [0, 1, 2, 3]),
    (3, 0.6, [0, 1]),  # both filters apply
    (1, 1.0, [0]),
  ],
)
def test_filter_logits_keeps_the_expected_tokens(top_k, top_p, kept):
  out = filter_logits(LOGITS, jnp.int32(top_k), jnp.float32(top_p))
  assert np.flatnonzero(np.isfinite(out[0])).tolist() == kept


def test_greedy_and_sampled_frequencies():
  keys = jax.random.split(jax.random.key(0), 4000)
  greedy = sample(jnp.repeat(LOGITS, 2, 0), keys[0], Sampling.create())
  assert greedy.tolist() == [0, 0]
  draw = jax.vmap(lambda k: sample(LOGITS, k, Sampling(temperature=1.0, top_k=3).arrays())[0])(keys)
  freq = np.bincount(np.asarray(draw), minlength=5) / len(keys)
  np.testing.assert_allclose(freq, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], atol=0.03)


def test_settings_as_written_and_as_the_command_line_gives_them_are_one_value():
  """Sampling(...) and Sampling.create(...) (None: filter off) hold the same settings; arrays()
  gives the traced dtypes."""
  written = Sampling(temperature=0.5, top_k=3, top_p=0.9).arrays()
  given = Sampling.create(0.5, 3, 0.9)
  for a, b, dtype in zip(written.__dict__.values(), given.__dict__.values(), ("float32", "int32", "float32")):
    assert a.dtype == b.dtype == dtype and float(a) == float(b)
  assert [float(x) for x in Sampling.create().__dict__.values()] == [0.0, 0.0, 1.0]  # greedy, no filters


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
  ],
)
def test_bad_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Sampling.create(**kwargs)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(temperature=-1.0), r"Sampling.temperature must be a finite number >= 0 \(0 is greedy\), got -1.0"),
    (dict(temperature=float("inf")), "Sampling.temperature must be a finite number"),
    (dict(temperature=True), "Sampling.temperature"),
    (dict(top_k=-1), r"Sampling.top_k must be an integer >= 0 \(0: no top-k filter\), got -1"),
    (dict(top_k=2.0), "Sampling.top_k"),
    (dict(top_p=0), r"Sampling.top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "Sampling.top_p"),
  ],
)
def test_a_sampling_value_checks_its_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Sampling(**kwargs)
