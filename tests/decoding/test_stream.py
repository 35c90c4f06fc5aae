"""stream (kvjax.decoding.stream) yields the tokens generate returns for the same prompt, sampling
value and key, token by token; both take the settings as one Sampling value."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax.decoding.sampling import Sampling
from kvjax.decoding.stream import stream
from conftest import init_params, tiny_config


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, top_k=8, top_p=0.9)])
def test_stream_yields_what_generate_returns(sampling):
  model, params = init_params(tiny_config(2))
  prompt = np.array([3, 1, 4, 1, 5], np.int32)
  want = np.asarray(kvjax.generate(model, params, prompt[None], [5], 6, sampling=sampling, rng=jax.random.key(7)))[
    0
  ].tolist()
  assert list(stream(model, params, prompt, 6, sampling=sampling, rng=jax.random.key(7))) == want


def test_stream_refuses_loose_settings():
  model, params = init_params(tiny_config(2))
  with pytest.raises(ValueError, match=r"sampling must be a kvjax.Sampling, got 0.5"):
    next(stream(model, params, np.array([1, 2]), 4, sampling=0.5))
