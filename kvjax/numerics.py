"""The arithmetic every route of a product agrees on, XLA's and the CPU kernels' alike.

Weights stored in bfloat16 or int8 (kvjax.model.weights) multiply activations rounded to
bfloat16, accumulating in float32; int8 values are exact in bfloat16, and the int8 format's scale
multiplies each output column afterwards. The rounding is done on the bits (`round_to_bfloat16`),
since XLA may drop a float32 -> bfloat16 -> float32 round trip as excess precision and then
multiply unrounded activations on some shapes and rounded ones on others.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

STORED_DTYPES = (jnp.bfloat16, jnp.int8)  # formats whose products round the activations


def round_to_bfloat16(x: jax.Array) -> jax.Array:
  """float32 x rounded to the nearest bfloat16 (ties to even), still float32."""
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
  return lax.bitcast_convert_type(bits, jnp.float32)


def matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, transposed: bool = False) -> jax.Array:
  """x [M, K] @ w [K, N] (x @ w.T for w [N, K] when `transposed`), times scale [N] per output
  column when given -> [M, N] in x's dtype, in XLA. Stored weights (STORED_DTYPES) multiply x
  rounded to bfloat16 in float32; float32 weights are taken in x's dtype."""
  contract = (((1,), (1 if transposed else 0,)), ((), ()))
  if w.dtype in STORED_DTYPES:
    rounded = round_to_bfloat16(x).astype(jnp.bfloat16)
    y = lax.dot_general(rounded, w.astype(jnp.bfloat16), contract, preferred_element_type=jnp.float32)
  else:
    y = lax.dot_general(x, w.astype(x.dtype), contract)
  return (y if scale is None else y * scale.astype(y.dtype)).astype(x.dtype)
