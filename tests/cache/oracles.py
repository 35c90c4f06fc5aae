"""The references the cache tests compare with: the full forward pass, with each layer's payload
as a codec stores it. Not a test module: the tests of tests/cache import it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.codec import Codec
from kvjax.model.attention import NoCache, new_keys


class StoredForward(NoCache):
  """The plain forward pass (every query over the call's payload under its layer's window mask;
  MLA reads it expanded), with each layer's payload as `codec` stores it: decode(encode(x))."""

  def __init__(self, codec: Codec, batch: int):
    self.codec, self.lengths = codec, jnp.zeros((batch,), jnp.int32)

  def attend(self, stored, query, q_positions, new, span, backend):
    stored_new = {name: self.codec.roundtrip(x) for name, x in new.items()}
    return stored, query.attend(stored_new, new_keys(q_positions, span))


def forward(model, params, tokens, kind=None) -> np.ndarray:
  """The full forward's logits [B, T, V] over tokens int[B, T], through the cache kind `kind`
  (None: the plain forward), jitted (eager apply runs op by op)."""
  return np.asarray(jax.jit(lambda p, t: model.apply({"params": p}, t, kind))(params, tokens))
