"""The train step and the state it advances: AdamW with warmup and cosine decay, the step-0 state
(initialised or given, placed on one device or sharded over a mesh), and one jitted step of
cross-entropy (optionally masked, optionally plus a distillation KL to a teacher).

The state (step, float32 params, optimizer state) is donated to every step. kvjax.training.train
runs the loop around it; kvjax.studies.base.tasks fine-tunes with the same step.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from kvjax import sharding
from kvjax.model.params import abstract_params, check_params
from kvjax.model.transformer import Transformer
from kvjax.training.config import TrainConfig

__all__ = [
  "TrainState",
  "init_state",
  "learning_rate_schedule",
  "make_optimizer",
  "make_train_step",
  "param_initializer",
  "place_state",
]


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW; weight decay applies to matrices (ndim >= 2) only."""
  return optax.chain(
    optax.clip_by_global_norm(config.clip_norm),
    optax.adamw(
      learning_rate_schedule(config),
      b1=config.b1,
      b2=config.b2,
      weight_decay=config.weight_decay,
      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    ),
  )


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
  """Learning rate of optimizer step `count` (from 0)."""
  warmup = optax.linear_schedule(0.0, config.lr, max(config.warmup_steps, 1))
  decay = optax.cosine_decay_schedule(config.lr, max(config.steps - config.warmup_steps, 1), alpha=config.min_lr_ratio)
  return optax.join_schedules([warmup, decay], [config.warmup_steps])


@functools.cache
def param_initializer(model: Transformer, mesh: Mesh | None = None):
  """-> jitted init(key) -> float32 params, sharded over `mesh` when given; cached per (model, mesh),
  so runs in one process compile it once."""
  init = lambda key: model.init(key, jnp.zeros((1, 1), jnp.int32))["params"]
  if mesh is None:
    return jax.jit(init)
  return jax.jit(init, out_shardings=sharding.param_sharding(abstract_params(model.config), mesh))


def place_state(state: TrainState, mesh: Mesh | None) -> TrainState:
  """The state committed to the default device, or sharded over `mesh`, as the train step's outputs
  are (an input placed otherwise would make the step compile a second time)."""
  return jax.device_put(state, jax.devices()[0]) if mesh is None else sharding.shard_params(state, mesh)


def init_state(
  model: Transformer, optimizer: optax.GradientTransformation, key: jax.Array, params=None, mesh: Mesh | None = None
) -> TrainState:
  """The step-0 state (from `params`, else freshly initialised), placed by `place_state`."""
  if params is None:
    params = param_initializer(model, mesh)(key)
  else:
    check_params(params, model.config, "init_params")
  if mesh is not None:
    params = sharding.shard_params(params, mesh)  # so the optimizer moments start out sharded too
  state = TrainState(step=np.int32(0), params=params, opt_state=optimizer.init(params))
  return place_state(state, mesh)


def make_train_step(
  model: Transformer,
  optimizer: optax.GradientTransformation,
  state_sharding=None,
  *,
  teacher: tuple[Transformer, Any] | None = None,
  distill: float = 0.0,
):
  """-> jitted step(state, inputs, targets, mask=None) -> (state, {"loss", "grad_norm"[, "distill_kl"]});
  donates `state`. `state_sharding` (kvjax.sharding.param_sharding of the state) pins the new state
  to the layout the step was given, so that feeding it back hits the one compiled step. A float32
  [B, T] `mask` averages the loss over the targets where it is 1 (fine-tuning on answers only)
  instead of over every token.

  With a teacher (model, params) and distill > 0 the objective adds distill x KL(teacher || model)
  of the next-token distributions, averaged over tokens (knowledge distillation); "loss" stays the
  data's cross-entropy and "distill_kl" is the KL term."""

  def step(state: TrainState, inputs: jax.Array, targets: jax.Array, mask, teacher_params):
    average = (lambda x: x.mean()) if mask is None else (lambda x: (x * mask).sum() / jnp.maximum(mask.sum(), 1.0))

    def loss_fn(params):
      logits = model.apply({"params": params}, inputs)  # [B, T, V] float32
      loss = average(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
      if teacher_params is None:
        return loss, {}
      target = jax.lax.stop_gradient(teacher[0].apply({"params": teacher_params}, inputs))
      kl = average((jax.nn.softmax(target) * (jax.nn.log_softmax(target) - jax.nn.log_softmax(logits))).sum(-1))
      return loss + distill * kl, {"loss": loss, "distill_kl": kl}

    (objective, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
    return new, {"loss": objective, **parts, "grad_norm": optax.tree.norm(grads)}

  jitted = jax.jit(step, donate_argnums=0, out_shardings=(state_sharding, None))
  # The teacher's own buffers: a student made from it (uptraining) shares arrays it would donate.
  teacher_params = jax.tree.map(jnp.copy, teacher[1]) if teacher is not None and distill > 0 else None

  def run_step(state: TrainState, inputs: jax.Array, targets: jax.Array, mask: jax.Array | None = None):
    return jitted(state, inputs, targets, mask, teacher_params)

  run_step.jitted = jitted  # the one compiled step, e.g. to count its compilations
  run_step.lower = lambda state, inputs, targets, mask=None: jitted.lower(state, inputs, targets, mask, teacher_params)
  return run_step
