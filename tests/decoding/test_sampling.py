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
  draw = jax.vmap(lambda k: sample(LOGITS, k, Sampling.create(temperature=1.0, top_k=3))[0])(keys)
  freq = np.bincount(np.asarray(draw), minlength=5) / len(keys)
  np.testing.assert_allclose(freq, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0], atol=0.03)


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
