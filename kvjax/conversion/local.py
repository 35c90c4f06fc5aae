"""Layer-local recovery: after a conversion (fewer kv heads, MLA), each converted layer's attention
learns to reproduce the source layer's attention output from the source layer's input, on
calibration tokens (`kvjax uptrain --recovery local`).

One layer's forward and backward per step, never a backward through the network: on two CPU
cores a 135M model recovers in minutes where end-to-end uptraining (`--recovery train`, with
`--distill`) takes hours. Layers are recovered in order. The calibration set's hidden states
x_l (the residual stream entering layer l) come from the source model alone: x_0 is the
embedding, x_{l+1} the source block l applied to x_l; the target is the source attention's output
on attn_norm(x_l), and the converted attention (its norm kept) is trained on the same input:

  loss_l = mean ||attn'(norm(x_l)) - attn(norm(x_l))||^2 / mean ||attn(norm(x_l))||^2

(the relative squared error, 1 at a zero output). Every attention parameter of the converted layer
trains (for kv heads: q, k, v, out; for MLA: its projections), with the run's AdamW settings
(TrainConfig: lr, warmup, cosine decay, clipping; weight decay left out: the target is the source
layer, not a prior), train.steps steps per layer on batches of train.batch_size windows drawn
from the calibration set by a generator seeded with train.seed and the layer.

Resumable and exact: each finished layer's attention is written to
WORKDIR/local/layer_{i}.safetensors, and local.json records each layer's loss before and after.
A rerun loads the finished layers, recomputes x_l from the source (a function of the calibration
tokens alone) and continues at the next layer, so an interrupted recovery ends with the same
params as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors.numpy import load_file, save_file

from kvjax.config import ModelConfig
from kvjax.model.attention import Span
from kvjax.model.transformer import Block
from kvjax.training.checkpoint import write_atomically
from kvjax.training.config import TrainConfig
from kvjax.training.step import learning_rate_schedule

LOG = "local.json"
FOLDER = "local"


def _span(batch: int, length: int) -> Span:
  return Span(
    positions=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)),
    lengths=jnp.full((batch,), length, jnp.int32),
    from_empty=True,
  )


def _attention(block: nn.Module, x: jax.Array) -> jax.Array:
  return block.attn(block.attn_norm(x), _span(*x.shape[:2]))


def _block(block: nn.Module, x: jax.Array) -> jax.Array:
  return block(x, _span(*x.shape[:2]))


def _embed(model: nn.Module, tokens: jax.Array) -> jax.Array:
  return model.embed(tokens) + (model.pos_embed(_span(*tokens.shape).positions) if hasattr(model, "pos_embed") else 0)


@dataclasses.dataclass(frozen=True)
class Layer:
  """A layer of a model of `config` as functions of its params tree (params["layers_i"]); hashable,
  so one compilation serves every layer that computes alike (`of`)."""

  config: ModelConfig
  index: int

  @classmethod
  def of(cls, config: ModelConfig, index: int) -> "Layer":
    """Layer `index`; index 0 stands for every layer when nothing in config tells layers apart
    (no sliding windows, no MLA rotary pairs chosen per layer)."""
    return cls(config, index if config.window or config.is_latent else 0)

  @property
  def module(self) -> Block:
    return Block(self.config, layer=self.index)

  def attention(self, params, x):
    """x [B, T, D] -> the attention branch's output [B, T, D] (before the residual add)."""
    return self.module.apply({"params": params}, x, method=_attention)

  def forward(self, params, x):
    """x [B, T, D] -> the block's output [B, T, D]."""
    return self.module.apply({"params": params}, x, method=_block)


@functools.partial(jax.jit, static_argnums=0)
def _attention_out(layer: Layer, params, x):
  return layer.attention(params, x)


@functools.partial(jax.jit, static_argnums=0)
def _block_out(layer: Layer, params, x):
  return layer.forward(params, x)


def hidden_states(model: nn.Module, params, tokens: np.ndarray, chunk: int) -> np.ndarray:
  """The residual stream entering layer 0 of `tokens` int[N, T] -> float32 [N, T, D]."""
  embed = jax.jit(lambda p, t: model.apply({"params": p}, t, method=_embed))
  return np.concatenate([np.asarray(embed(params, tokens[i : i + chunk])) for i in range(0, len(tokens), chunk)])


def _batched(fn, layer: Layer, params, x: np.ndarray, chunk: int) -> np.ndarray:
  return np.concatenate([np.asarray(fn(layer, params, x[i : i + chunk])) for i in range(0, len(x), chunk)])


def relative_error(pred: jax.Array, target: jax.Array) -> jax.Array:
  return jnp.mean(jnp.square(pred - target)) / jnp.maximum(jnp.mean(jnp.square(target)), 1e-30)


def _optimizer(train: TrainConfig) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(train.clip_norm), optax.adam(learning_rate_schedule(train)))


def _loss(layer: Layer, attn, layer_params, xb, tb):
  return relative_error(layer.attention({**layer_params, "attn": attn}, xb), tb)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _step(layer: Layer, train: TrainConfig, attn, state, layer_params, xb, tb):
  value, grads = jax.value_and_grad(functools.partial(_loss, layer))(attn, layer_params, xb, tb)
  updates, state = _optimizer(train).update(grads, state, attn)
  return optax.apply_updates(attn, updates), state, value


@functools.partial(jax.jit, static_argnums=0)
def _squares(layer: Layer, attn, layer_params, xb, tb):
  """(summed squared error, summed squared target) of a batch."""
  pred = layer.attention({**layer_params, "attn": attn}, xb)
  return jnp.sum(jnp.square(pred - tb)), jnp.sum(jnp.square(tb))


def recover_layer(
  layer: Layer, index: int, attn_params, layer_params, x: np.ndarray, target: np.ndarray, train: TrainConfig
):
  """Trains attn_params (layer_params["attn"] of the converted layer) so that the converted
  attention maps x [N, T, D] to target [N, T, D]; returns (attn params, loss before, loss after)
  with the losses over the whole calibration set. Training that does not lower the loss is not
  kept: the layer stays as converted."""
  size = train.batch_size

  def whole(attn):  # the relative error over the whole set
    sums = [_squares(layer, attn, layer_params, x[i : i + size], target[i : i + size]) for i in range(0, len(x), size)]
    return sum(float(e) for e, _ in sums) / max(sum(float(t) for _, t in sums), 1e-30)

  before = whole(attn_params)
  rng = np.random.default_rng([train.seed, index])  # layer `index`'s own draws
  state = _optimizer(train).init(attn_params)
  trained = attn_params
  for _ in range(train.steps):
    rows = rng.choice(len(x), size=min(size, len(x)), replace=False)
    trained, state, _ = _step(layer, train, trained, state, layer_params, x[rows], target[rows])
  after = whole(trained)
  return (trained, before, after) if after < before else (attn_params, before, before)


def recover(
  source: tuple[nn.Module, dict],
  converted: tuple[ModelConfig, dict],
  calibration: np.ndarray,
  train: TrainConfig,
  workdir: str | Path,
  progress=print,
) -> tuple[dict, list[dict]]:
  """Layer-local recovery of the converted params (see the module docstring).

  Args:
    source: (Transformer, params) of the model before conversion.
    converted: (ModelConfig, params) after it, same layers and model width.
    calibration: int32 [N, T] calibration tokens.
    train: steps per layer, batch_size (windows), lr, warmup_steps, min_lr_ratio, clip_norm, seed.
    workdir: where finished layers are kept (FOLDER) and logged (LOG); resumed from.
  Returns:
    (recovered params, per-layer log [{layer, loss_before, loss_after}]).
  """
  model, params = source
  config, new_params = converted
  workdir = Path(workdir)
  (workdir / FOLDER).mkdir(parents=True, exist_ok=True)
  log_path = workdir / LOG
  log = json.loads(log_path.read_text()) if log_path.exists() else []
  chunk = max(1, train.batch_size)
  x = hidden_states(model, params, calibration, chunk)
  new_params = dict(new_params)
  for i in range(model.config.num_layers):
    name = f"layers_{i}"
    original, recovered = Layer.of(model.config, i), Layer.of(config, i)
    stored = workdir / FOLDER / f"{name}.safetensors"
    if i < len(log) and stored.exists():
      attn = unflatten_dict({tuple(k.split("/")): jnp.asarray(v) for k, v in load_file(stored).items()})
    else:
      target = _batched(_attention_out, original, params[name], x, chunk)
      attn, before, after = recover_layer(recovered, i, new_params[name]["attn"], new_params[name], x, target, train)
      save_file({"/".join(k): np.asarray(v) for k, v in flatten_dict(attn).items()}, str(stored))
      log = log[:i] + [{"layer": i, "loss_before": before, "loss_after": after}]
      write_atomically(log_path, json.dumps(log, indent=2) + "\n")
      progress(f"local recovery: layer {i}: relative error {before:.4f} -> {after:.4f}")
    new_params[name] = {**new_params[name], "attn": attn}
    x = _batched(_block_out, original, params[name], x, chunk)
  return new_params, log
