"""KVzip (Kim et al. 2025, arXiv 2505.23416): a key-value pair is worth what the model pays it
while it reconstructs the context, read again after a "repeat" prompt and teacher-forced.

Query-agnostic, and a model-level pass: the reconstruction's queries at layer l come out of every
layer below it, so no layer can score its prompt alone as the other presses do
(kvjax.cache.presses). The first call into an evicting cache whose press is KVzip (the cache's
first-call hook, KVCache.first_call, which the decode functions' traced forward asks) therefore
runs, in this module
  1. the prompt through a full (contiguous) cache, its logits the prefill's;
  2. per chunk of `chunk_size` context tokens (from `prefix`, the chat template's opening, which
     is not reconstructed), the replay  repeat_ids + suffix_ids + chunk  (a later chunk:
     resume_ids + the previous chunk's last 8 tokens + suffix_ids + chunk) after the context, at
     the positions that follow it, through a `ReplayCache`: each layer's replay queries attend
     as usual, and beside that each layer scores the chunk's keys by the softmax of the replay
     queries over the sinks, the chunk and the replay itself (causal), the maximum over the
     replay's queries and over the query heads of each kv head;
  3. the `sinks` first positions scored above every other score, the chat template's opening
     (between the sinks and `prefix`) zero; a row keeps its best tokens over every layer and kv
     head together (`layerwise`: over every kv head of each layer), as many as the ratio leaves:
     total - int(total * compression_ratio) of total = layers x kv heads x its tokens
     (per layer: kv heads x tokens), kvpress's KVzipPress rule.
The cache stores them as an evicting cache does (kvjax.cache.layouts.evict), per layer and kv head in its
slots, read by positions (heads hold different numbers). A head's slots are static while its
share is known only once the row is scored: `head_share` bounds it, a head keeping at most
int(n * head_share) of a row's n tokens, and the slots are sized for that (Press.storage_ratio).
The default, 1, is kvpress's KVzip (any head may keep any number), at the storage of the whole
prompt; head_share = 1 - compression_ratio stores what a uniform press stores, each head then
keeping its even share; between, a head that the row's ranking favours beyond its share keeps its
best and the row's other heads take what it leaves. Later tokens (the question, the answer, a later turn) arrive as they
do under the attention presses: they score above every attention weight and are evicted oldest
first once a head is full.

The repeat prompt's token ids come from the model's tokenizer (KVzip.bind, which CacheConfig.bind
calls where a model is loaded with its tokenizer: kvpress's texts, and the chat template's opening
and reply header found as kvpress finds them, by rendering a dummy user turn); a KVzip without
them is refused when a prefill needs them. KVzip needs a global-attention model (kvpress refuses
Gemma 3): windowed layers are refused (kvjax.cache.selection).

Scores are float32 [B, K, T] per layer, as every press's.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.config import CacheConfig
from kvjax.cache.layouts.contiguous import ContiguousCache
from kvjax.cache.presses import Press
from kvjax.fields import INT32_MAX, check_nonnegative, check_positive, check_real
from kvjax.model.attention import Span
from kvjax.model.keys import NEG_INF, group_queries
from kvjax.model.transformer import Transformer, apply_cached, cache_collection, cache_layers

CONTINUED = 8  # tokens of the previous chunk a later chunk's replay quotes (kvpress's prev_postfix_size)
REPEAT = "\n\nRepeat the previous context exactly."  # kvpress's KVzipPress.prepare, the first chunk
RESUME = "\n\nRepeat the part of the previous context exactly, starting with"  # a later chunk
DUMMY = "dummy context"


def _token_ids(press, name: str) -> None:
  value = getattr(press, name)
  if isinstance(value, (list, np.ndarray)):
    value = tuple(int(i) for i in value)
  if not isinstance(value, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
    raise ValueError(f"KVzip.{name} must be a tuple of token ids (non-negative ints), got {value!r}")
  object.__setattr__(press, name, value)


@dataclasses.dataclass(frozen=True)
class KVzip(Press):
  """The KVzip press (module docstring). heads must stay "uniform": KVzip ranks a row's tokens
  over its heads (and layers) itself."""

  sinks: int = 4
  chunk_size: int = 2048
  layerwise: bool = False
  head_share: float = 1.0
  prefix: int = 0
  repeat_ids: tuple[int, ...] = ()
  resume_ids: tuple[int, ...] = ()
  suffix_ids: tuple[int, ...] = ()
  name: ClassVar[str] = "kvzip"

  def __post_init__(self):
    super().__post_init__()
    if self.heads != "uniform":
      raise ValueError(
        f"KVzip.heads={self.heads!r}: KVzip already ranks a row's tokens over all its kv heads (and "
        "layers, unless layerwise); leave heads='uniform'"
      )
    check_nonnegative(self, "sinks", "prefix", most=INT32_MAX)
    check_positive(self, "chunk_size", most=INT32_MAX)
    check_real(self, "head_share", 0, 1, open_low=True)
    object.__setattr__(self, "head_share", float(self.head_share))
    if self.head_share < 1 - self.compression_ratio - 1e-9:  # 1 - 0.7 is 0.30000000000000004
      raise ValueError(
        f"KVzip.head_share={self.head_share} is less than the share 1 - compression_ratio = "
        f"{1 - self.compression_ratio:g} that every head would keep evenly; the budget cannot be met"
      )
    if not isinstance(self.layerwise, bool):
      raise ValueError(f"KVzip.layerwise must be True or False, got {self.layerwise!r}")
    for name in ("repeat_ids", "resume_ids", "suffix_ids"):
      _token_ids(self, name)

  @property
  def model_level(self) -> bool:
    return True

  @property
  def uneven_heads(self) -> bool:
    return True

  @property
  def storage_ratio(self) -> float:
    return 1 - self.head_share

  @property
  def replayer(self) -> "KVzip":
    """What a prompt's reconstruction reads (the repeat prompt, chunks, sinks): presses with the
    same replayer score a prompt alike, whatever their ratio, head share or ranking
    (reconstruct)."""
    return dataclasses.replace(self.scoring, head_share=1.0, layerwise=False, compression_ratio=0.5)

  def check_prompt(self, vocab_size: int) -> None:
    """Raises ValueError unless the repeat prompt's token ids are set and inside the vocabulary."""
    if not self.repeat_ids or not self.resume_ids:
      raise ValueError(
        "KVzip needs its repeat prompt's token ids (KVzip.repeat_ids, resume_ids, suffix_ids, prefix), "
        "which come from the model's tokenizer: CacheConfig.bind(tokenizer), as `kvjax eval`, `kvjax generate` "
        "and the studies do"
      )
    for name in ("repeat_ids", "resume_ids", "suffix_ids"):
      bad = [i for i in getattr(self, name) if i >= vocab_size]
      if bad:
        raise ValueError(f"KVzip.{name} holds token id {bad[0]}, outside [0, vocab_size={vocab_size})")

  def scores(self, q, k, lengths):
    raise ValueError("KVzip scores a prompt in a model-level pass (KVzip.prefill), not inside one layer")

  def bind(self, tokenizer) -> "KVzip":
    """This press with its repeat prompt in `tokenizer`'s ids (a kvjax.interop TextTokenizer),
    unless it has one: kvpress's texts, the chat template's opening (`prefix`, not reconstructed)
    and reply header (`suffix_ids`). ValueError without a tokenizer."""
    if self.repeat_ids:
      return self
    if tokenizer is None:
      raise ValueError(
        f"CacheConfig.press={self!r}: KVzip's repeat prompt is read in the model's tokens, and this model has no tokenizer"
      )
    if tokenizer.chat_template is None:
      prefix, suffix = "", "\n"
    else:
      separator = "\n" + "#" * len(DUMMY)
      text = tokenizer.apply_chat_template([{"role": "user", "content": DUMMY + separator}], add_generation_prompt=True)
      context, suffix = text.split(separator)
      prefix = context.split(DUMMY)[0]
    encode = lambda text: tuple(int(i) for i in tokenizer.encode(text))
    return dataclasses.replace(
      self, repeat_ids=encode(REPEAT), resume_ids=encode(RESUME), suffix_ids=encode(suffix), prefix=len(encode(prefix))
    )

  def prefill(self, model: Transformer, params, cache, tokens: jax.Array, lengths: jax.Array, logits_at=None):
    """Right-padded prompts tokens int32[B, T], lengths int32[B] into the empty evicting cache
    `cache` -> (logits as Transformer returns them at logits_at, the pressed cache). Traced."""
    if self.compression_ratio > 0:  # ratio 0 keeps every token without a reconstruction
      self.check_prompt(model.config.vocab_size)
    logits, full, scores = reconstruct(model, params, self, tokens, lengths, logits_at)
    return logits, fill(model.config, cache, full, scores, lengths)

  def replay_room(self, width: int) -> int:
    """Positions a replay of a prompt `width` columns wide takes after it."""
    head = max(len(self.repeat_ids), len(self.resume_ids) + CONTINUED)
    return head + len(self.suffix_ids) + min(self.chunk_size, width)

  def chunks(self, width: int) -> list[int]:
    """The first context column of each chunk of a prompt `width` columns wide."""
    return list(range(self.prefix, width, self.chunk_size))

  def replay(self, tokens: jax.Array, lengths: jax.Array, start: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The replay of the chunk from column `start` of right-padded tokens int[B, T] (lengths
    int[B]) -> (tokens int32[B, W], lengths int32[B]: 0 for a row whose context ends before the
    chunk, the chunk's end int32[B])."""
    end = jnp.minimum(lengths, start + self.chunk_size)
    chunk = tokens[:, start : start + self.chunk_size]
    if start == self.prefix:
      head = jnp.broadcast_to(jnp.asarray(self.repeat_ids, jnp.int32), (tokens.shape[0], len(self.repeat_ids)))
    else:
      asked = jnp.broadcast_to(jnp.asarray(self.resume_ids, jnp.int32), (tokens.shape[0], len(self.resume_ids)))
      head = jnp.concatenate([asked, tokens[:, start - CONTINUED : start]], axis=1)
    suffix = jnp.broadcast_to(jnp.asarray(self.suffix_ids, jnp.int32), (tokens.shape[0], len(self.suffix_ids)))
    replay = jnp.concatenate([head, suffix, chunk], axis=1).astype(jnp.int32)
    size = end - start
    replay_lengths = jnp.where(size > 0, head.shape[1] + suffix.shape[1] + size, 0).astype(jnp.int32)
    return replay, replay_lengths, end

  def kept(self, scores: jax.Array, lengths: jax.Array, room: jax.Array) -> jax.Array:
    """bool [L, B, K, T]: the tokens a row keeps of scores float32 [L, B, K, T] (-inf: padding),
    its prompt lengths int[B]; no (layer, head) keeps more than int(n * head_share) of a row's n
    tokens, nor more than `room` (int32 scalar, the slots)."""
    layers, b, k, t = scores.shape
    share = np.floor(np.arange(t + 1) * self.head_share).astype(np.int64)
    cap = jnp.minimum(jnp.asarray(share, jnp.int32)[lengths], room)  # [B]
    rank = jnp.argsort(jnp.argsort(-scores, axis=-1, stable=True), axis=-1)  # within each head
    scores = jnp.where(rank < cap[None, :, None, None], scores, -jnp.inf)
    pool = layers * k if not self.layerwise else k  # entries a row's budget spans, per token
    total = pool * np.arange(t + 1, dtype=np.float64)
    budget = jnp.asarray((total - np.floor(total * self.compression_ratio)).astype(np.int64), jnp.int32)[lengths]
    if self.layerwise:  # [L, B, K * T]: each layer alone
      flat = scores.reshape(layers, b, k * t)
      keep = (jnp.argsort(jnp.argsort(-flat, axis=-1, stable=True), axis=-1) < budget[None, :, None]).reshape(
        scores.shape
      )
    else:  # [B, L * K * T]: the row's layers together (ties: the lower layer, head, position)
      flat = scores.transpose(1, 0, 2, 3).reshape(b, layers * k * t)
      keep = jnp.argsort(jnp.argsort(-flat, axis=-1, stable=True), axis=-1) < budget[:, None]
      keep = keep.reshape(b, layers, k, t).transpose(1, 0, 2, 3)
    return keep & jnp.isfinite(scores)

  def final_scores(self, scores: jax.Array, lengths: jax.Array) -> jax.Array:
    """scores float32 [L, B, K, T] of the reconstructed columns (zero elsewhere) with the sinks
    raised above every score of their row and the padding -inf."""
    t = scores.shape[-1]
    column = jnp.arange(t)
    best = scores.max(axis=(0, 2, 3))[None, :, None, None]  # [1, B, 1, 1]
    scores = jnp.where(column < self.sinks, best + 1, scores)
    valid = column[None, :] < lengths[:, None]  # [B, T]
    return jnp.where(valid[None, :, None], scores, -jnp.inf)


class ReplayCache(ContiguousCache):
  """A contiguous cache holding a prompt, through which a replay runs: each layer attends as the
  contiguous cache does and stores beside its arrays `kvzip` float32 [B, K, width], the KVzip score
  of the chunk's columns [chunk_start, chunk_end[b]) (zero elsewhere).

  chunk_end: int32[B]; chunk_start, sinks, width (static): the chunk, the press's sinks and the
  prompt's width (the columns a score can fall on; the slots after it hold the replay)."""

  chunk_end: jax.Array | None = None
  chunk_start: int = flax.struct.field(pytree_node=False, default=0)
  sinks: int = flax.struct.field(pytree_node=False, default=0)
  width: int = flax.struct.field(pytree_node=False, default=0)

  def attend(self, stored, query, q_positions, new, span: Span, backend):
    if not 0 < self.width <= self.capacity:
      raise ValueError(f"ReplayCache.width must be the prompt's width, 1..{self.capacity} slots, got {self.width}")
    context = self.readable(stored)["k"][..., : self.width]  # [B, K, H, T]: the prompt's keys
    stored, out = super().attend(stored, query, q_positions, new, span, backend)
    every_q = query.every_q  # [B, W, N, H]: every replay column's queries
    h = every_q.shape[-1]
    q = group_queries(every_q, context.shape[1]) * h**-0.5  # [B, W, K, G, H]
    column = jnp.arange(self.width)
    chunk = (column[None, :] >= self.chunk_start) & (column[None, :] < self.chunk_end[:, None])  # [B, T]
    seen = chunk | (column < min(self.sinks, self.chunk_start))[None, :]
    on_context = jnp.einsum("bwkgh,bkhs->bkgws", q, context.astype(q.dtype), preferred_element_type=jnp.float32)
    on_replay = jnp.einsum("bwkgh,bkjh->bkgwj", q, new["k"].astype(q.dtype), preferred_element_type=jnp.float32)
    w = q.shape[1]
    causal = (jnp.arange(w)[None, :] <= jnp.arange(w)[:, None])[None] & span.valid[:, None, :]  # [B, W, W]
    on_context = jnp.where(seen[:, None, None, None], on_context, NEG_INF)
    on_replay = jnp.where(causal[:, None, None], on_replay, NEG_INF)
    # The softmax over the seen context and the replay, without joining them: each query's log
    # normalizer from both parts, then a context column's score is its largest weight over the
    # replay's queries and the kv head's query heads, exp(max(logit - log normalizer)).
    top = jnp.maximum(on_context.max(axis=-1), on_replay.max(axis=-1))  # [B, K, G, W]
    total = jnp.exp(on_context - top[..., None]).sum(axis=-1) + jnp.exp(on_replay - top[..., None]).sum(axis=-1)
    log_weights = on_context - (top + jnp.log(total))[..., None]
    log_weights = jnp.where(span.valid[:, None, None, :, None], log_weights, -jnp.inf)
    score = jnp.where(chunk[:, None], jnp.exp(log_weights.max(axis=(2, 3))), 0.0)  # [B, K, T]
    return stored | {"kvzip": score}, out


def pressed_layer(cache, new: dict, scores: jax.Array, keep: jax.Array) -> dict:
  """An evicting cache's arrays (kvjax.cache.layouts.evict: slots, positions, scores) of one layer
  holding the kept tokens: new {k, v} [B, K, T, H] at positions 0..T-1, scores float32 [B, K, T],
  keep bool [B, K, T]."""
  b, _, t = scores.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return cache.keep(new, jnp.where(keep, scores, -jnp.inf), keep.sum(axis=-1, dtype=jnp.int32), positions)


def reconstruct(model: Transformer, params, press: KVzip, tokens: jax.Array, lengths: jax.Array, logits_at=None):
  """Steps 1 and 2 of KVzip (kvjax.cache.kvzip): the prompt through a full cache, then its
  reconstruction -> (logits at logits_at, the full ContiguousCache, scores float32 [L, B, K, T]
  with the sinks raised and the padding -inf). They depend on the press's repeat prompt, chunks
  and sinks only (KVzip.replayer), so one reconstruction serves every ratio and head share."""
  config = model.config
  b, t = tokens.shape
  room = press.replay_room(t) if press.compression_ratio > 0 else 0  # ratio 0 keeps every token unscored
  full = ContiguousCache.create(config, b, t + room, CacheConfig())
  logits, layers = apply_cached(model, params, full, tokens, lengths, logits_at, from_empty=True)
  full = full.replace(layers=layers, lengths=lengths)
  scores = jnp.zeros((config.num_layers, b, config.num_kv_heads, t), jnp.float32)
  if press.compression_ratio > 0:
    for start in press.chunks(t):
      replay, replay_lengths, end = press.replay(tokens, lengths, start)
      held = {f.name: getattr(full, f.name) for f in dataclasses.fields(ContiguousCache)}
      scorer = ReplayCache(**held, chunk_end=end, chunk_start=start, sinks=press.sinks, width=t)
      _, replayed = apply_cached(model, params, scorer, replay, replay_lengths)
      scores = scores + jnp.stack([layer["kvzip"] for layer in cache_layers(replayed)])
  return logits, full, press.final_scores(scores, lengths)


def fill(config, cache, full: ContiguousCache, scores: jax.Array, lengths: jax.Array):
  """The empty evicting cache `cache` (kvjax.cache.layouts.evict, of a model of `config`) holding what its press keeps of the prompt in `full`, scored
  by `scores` (reconstruct's)."""
  t = scores.shape[-1]
  keep = cache.press.kept(scores, lengths, cache.usable().sum(dtype=jnp.int32))
  stored = cache_layers(full.layers)

  def layer(i):
    arrays = full.readable(stored[i])
    new = {"k": arrays["k"][..., :t].swapaxes(2, 3), "v": arrays["v"][:, :, :t]}  # [B, K, T, H]
    return pressed_layer(cache, new, scores[i], keep[i])

  return cache.replace(layers=cache_collection(config, layer), lengths=cache.lengths + lengths)
