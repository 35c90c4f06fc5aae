"""The engine's mixed step (kvjax.serving.engine): the decode rows and prompt chunks in one call.

A step runs the next token of every decoding row and a chunk of each prompt still being computed
as one call of the model over one packed row of tokens:

  [row 0's token, ..., row B-1's token, chunk 0's C tokens, ..., chunk R-1's C tokens]

Every product before and after attention works token by token, so it runs once over the packed
row and reads each weight once for the decode rows and the chunks together. Attention works row
by row, so `Mixed` hands the paged cache each part as the rows it is: the decode tokens as B rows
of one token, each chunk as a row of C, all over the same pools. Each part writes its new keys
and values into its own pages and reads them as it would in a call of its own (a layout whose
`attend` is its `write`, then its `read`: the paged one), so a row's result is the one of a
decode step or an extension of its own.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.cache.layouts.paged import PagedCache
from kvjax.model.attention import Span
from kvjax.model.backend import Backend
from kvjax.model.transformer import Transformer, apply_cached


class Mixed(flax.struct.PyTreeNode):
  """A packed call over the rows of a paged cache: rows[:decode_rows] take one token each, the
  rest a chunk of C tokens each (C: what the call's width leaves after the decode tokens).

  layers: the pools ('cache' collection); rows: the paged cache whose page table and lengths
  address the B + R rows (its own layers empty); new int32[B + R]: the real tokens of each row's
  part (a chunk's padding columns write into the null page and their outputs are never read)."""

  layers: dict
  rows: PagedCache
  new: jax.Array
  decode_rows: int = flax.struct.field(pytree_node=False, default=0)

  def call_positions(self, t: int) -> jax.Array:
    """int32[1, t]: each decode token at its row's length, each chunk's columns after its row's."""
    b = self.decode_rows
    starts = self.rows.lengths
    chunks = starts[b:, None] + jnp.arange((t - b) // (starts.shape[0] - b), dtype=jnp.int32)
    return jnp.concatenate([starts[:b], chunks.reshape(-1)])[None]

  def layer_window(self, config, layer: int):
    return self.rows.layer_window(config, layer)

  def rotate_in(self, query, new: dict):
    return self.rows.rotate_in(query, new)

  def rotate_out(self, out: jax.Array) -> jax.Array:
    return self.rows.rotate_out(out)

  def attend(self, stored: dict, query, q_positions, new: dict, span: Span, backend: Backend):
    """query and q_positions [1, Tq, ...] (every column's, or at the last layer one per row: each
    decode token and each chunk's last real one), new {name: [1, heads, T, width]} -> (the pools,
    [1, Tq, N, H])."""
    b, rows = self.decode_rows, self.rows
    chunks = rows.lengths.shape[0] - b
    width = (next(iter(new.values())).shape[2] - b) // chunks  # C
    per_row = q_positions.shape[1] != b + chunks  # the chunks' every column, not their last ones

    def decode_part(x, axis):  # [1, ..., B + ..., ...] -> [B, ..., 1, ...]
      return jnp.expand_dims(jnp.moveaxis(jax.lax.slice_in_dim(x[0], 0, b, axis=axis - 1), axis - 1, 0), axis)

    def chunk_part(x, axis, columns):  # -> [R, ..., columns, ...]
      rest = jax.lax.slice_in_dim(x[0], b, None, axis=axis - 1)
      rest = rest.reshape(rest.shape[: axis - 1] + (chunks, columns) + rest.shape[axis:])
      return jnp.moveaxis(rest, axis - 1, 0)

    outputs = width if per_row else 1
    decode = rows.with_rows(rows.page_table[:b], rows.lengths[:b])
    chunk = rows.with_rows(rows.page_table[b:], rows.lengths[b:])
    decode_span = span.replace(positions=rows.lengths[:b, None], lengths=self.new[:b])
    chunk_span = span.replace(
      positions=rows.lengths[b:, None] + jnp.arange(width, dtype=jnp.int32), lengths=self.new[b:]
    )
    # Both parts write before either reads: a pool written after a read would be copied whole.
    queries = (query.map_tokens(lambda x: decode_part(x, 1)), query.map_tokens(lambda x: chunk_part(x, 1, outputs)))
    stored = decode.write(stored, {name: decode_part(x, 2) for name, x in new.items()}, decode_span)
    stored = chunk.write(stored, {name: chunk_part(x, 2, width) for name, x in new.items()}, chunk_span)
    decoded = decode.read(stored, queries[0], decode_part(q_positions, 1), decode_span, backend)
    chunked = chunk.read(stored, queries[1], chunk_part(q_positions, 1, outputs), chunk_span, backend)
    out = jnp.concatenate([decoded.reshape((b,) + decoded.shape[2:]), chunked.reshape((-1,) + chunked.shape[2:])])
    return stored, out[None]


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def step(model: Transformer, params, cache: PagedCache, tokens, chunks, chunk_lengths):
  """One token of each of the cache's first B rows (tokens int32[B]) and a chunk of context for each
  of its last R rows (chunks int32[R, C], chunk_lengths int32[R] real, each at least 1), written
  after what each row holds -> (next-token logits float32 [B + R, V]: each decode row's, then each
  chunk's after its last real token; the cache)."""
  if cache.layout != "paged":
    raise ValueError(f"a mixed step runs over the paged layout (a write, then a read), not {cache.layout!r}")
  b, (r, c) = tokens.shape[0], chunks.shape
  packed = jnp.concatenate([tokens, chunks.reshape(-1)])[None]
  logits_at = jnp.concatenate([jnp.arange(b), b + jnp.arange(r) * c + chunk_lengths - 1])[None]
  view = Mixed(
    layers=cache.layers,
    rows=cache.replace(layers={}),
    new=jnp.concatenate([jnp.ones_like(tokens), chunk_lengths]).astype(jnp.int32),
    decode_rows=b,
  )
  logits, layers = apply_cached(model, params, view, packed, jnp.array([b + r * c], jnp.int32), logits_at)
  return logits[0], cache.replace(layers=layers)
