"""How the model's products are computed: XLA unless a decode entry point swaps in kernels.

The model definition never imports a kernel. `Transformer(config, backend=...)` takes a Backend
whose functions its Dense layers and its cache kinds call; the default computes everything in
XLA. kvjax.decoding builds the CPU-kernel backend (kvjax.kernels) once, before tracing, and hands
it to the model at its entry points (prefill, extend, decode_step, generate, the engine), so
training, evaluation and conversion always run the plain XLA model.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


from kvjax import numerics


xla_matmul = numerics.matmul
"""The default product of a Dense or Embed layer, whatever format its weights are stored in
(kvjax.numerics.matmul)."""


def xla_cache_attention(route, q, k_cache, v_cache, lengths, xla: Callable, **addressing):
  """The default route of one-token attention over a cache: XLA's computation, `xla`, as it is."""
  return xla(q, k_cache, v_cache, lengths, **addressing)


def xla_prompt_attention(q, k, v, keys, xla: Callable, *, k_transposed: bool = False):
  """The default route of a call's queries over its own keys: XLA's computation, `xla`, as it is."""
  return xla(q, k, v, keys, k_transposed=k_transposed)


@dataclasses.dataclass(frozen=True)
class Backend:
  """Routes for the products a forward pass computes. Hashable: it is part of the jitted model.

  matmul: every Dense and Embed layer's product (xla_matmul's signature), whatever format the
    weights are stored in (kvjax.model.weights).
  cache_attention: (route, q [B, 1, N, H], k_cache, v_cache, lengths int32[B], xla, **addressing)
    -> [B, 1, N, H], one query token per row reading positions [0, lengths[b]] of a K/V cache.
    `route` is what the cache kind says it is: (layout, codec name), e.g. ("contiguous", "int8")
    with k_cache [B, K, H, S] and v_cache [B, K, S, H] (kvjax.cache.layouts.contiguous) or ("paged",
    "float32") with page pools [K, P, Z, H] and the keyword page_table int32[B, M]
    (kvjax.cache.layouts.paged); a quantized codec adds its scales as k_scale and v_scale. `xla` is the
    reference computation (xla(q, k_cache, v_cache, lengths, **addressing)), which a route falls
    back to for what it does not take.
  prompt_attention: (q [B, T, N, H], k, v [B, K, S, H] (k [B, K, H, S] with k_transposed), keys
    kvjax.model.keys.Visibility, xla, *, k_transposed) -> [B, T, N, H]: a call's queries over its
    own new keys (a prefill from an empty cache); `xla` (kvjax.model.keys.attend_keys) is the
    reference computation, with the same arguments.
  """

  matmul: Callable = xla_matmul
  cache_attention: Callable = xla_cache_attention
  prompt_attention: Callable = xla_prompt_attention


XLA = Backend()
