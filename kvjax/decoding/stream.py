"""Token streaming: one prompt decoded token by token on the host, for a terminal or a server.

`generate` runs its whole decode loop inside one jitted lax.while_loop, so nothing comes out until
every row has finished. `stream` yields each token as soon as it is sampled: a prefill, then one
jitted `decode_step` per token. It draws its random keys in the order `generate` does, so the
tokens it yields are the ones `generate` returns for the same prompt, settings and key (greedy or
sampled), up to and including the first stop token.

`TextStream` turns those tokens into text increments: a byte-level BPE token may end inside a
multi-byte character, so text is released only once it decodes cleanly.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from kvjax.cache.config import CacheConfig
from kvjax.fields import check_positive_int
from kvjax.decoding.decode import check_stop_ids, check_tokens, decode_step, prefill, size_bucket
from kvjax.decoding.sampling import Sampling, check_sampling, sample
from kvjax.model.transformer import Transformer

_sample = jax.jit(sample)


def stream(
  model: Transformer,
  params,
  prompt,
  max_new_tokens: int,
  *,
  sampling: Sampling = Sampling(),
  stop_ids: Sequence[int] | int = (),
  rng: jax.Array | None = None,
  mesh=None,
  cache_config: CacheConfig = CacheConfig(),
) -> Iterator[int]:
  """Yields the tokens generated after `prompt` (int [T]), one at a time: at most max_new_tokens,
  ending after the first of `stop_ids` (which is yielded). Settings as in `generate`."""
  check_positive_int(max_new_tokens, "max_new_tokens")
  prompt, _ = check_tokens(model, np.asarray(prompt)[None, :], [len(prompt)])
  stop_ids = check_stop_ids(stop_ids, model.config.vocab_size)
  length = prompt.shape[1]
  config = cache_config.model(model.config)
  config.check_length(
    length + max_new_tokens - 1,
    f"prompt of {length} tokens + max_new_tokens={max_new_tokens} needs {length + max_new_tokens - 1} cache positions",
  )
  sampling = check_sampling(sampling)
  # Prompts padded to a bucket compile prefill once per bucket, as generate's do.
  bucket = size_bucket(length, config.max_positions - max_new_tokens + 1)
  padded = np.zeros((1, bucket), np.int32)
  padded[:, :length] = prompt
  logits, cache = prefill(
    model, params, padded, [length], bucket + max_new_tokens - 1, logits="last", mesh=mesh, cache_config=cache_config
  )
  rng = jax.random.key(0) if rng is None else rng
  for step in range(max_new_tokens):
    rng, key = jax.random.split(rng)
    token = int(_sample(logits, key, sampling)[0])
    yield token
    if token in stop_ids or step == max_new_tokens - 1:
      return
    logits, cache = decode_step(model, params, cache, np.array([token], np.int32), mesh=mesh)


class TextStream:
  """Text increments of a growing token sequence: `push(token)` returns the text that token
  completes ('' while it ends inside a character), `decode` is any ids -> str function."""

  def __init__(self, decode: Callable[[list[int]], str]):
    self._decode = decode
    self._ids: list[int] = []
    self._shown = 0

  def push(self, token: int) -> str:
    self._ids.append(int(token))
    text = self._decode(self._ids)
    if text.endswith("\ufffd"):  # a character cut by the token boundary: wait for the next token
      return ""
    new, self._shown = text[self._shown :], len(text)
    return new

  def flush(self) -> str:
    """The text not yet returned (a cut character at the very end shows as U+FFFD)."""
    text = self._decode(self._ids)
    new, self._shown = text[self._shown :], len(text)
    return new
