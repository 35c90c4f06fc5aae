"""Distillation: a teacher equal to the student adds no loss and changes no update; a teacher
pulls the student's distribution towards its own; distill needs a teacher."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.training.config import TrainConfig
from kvjax.training.step import TrainState, make_optimizer, make_train_step
from conftest import init_params, tiny_config

INPUTS = np.asarray(jax.random.randint(jax.random.key(3), (4, 16), 0, 64), np.int32)
TARGETS = np.roll(INPUTS, -1, axis=1)


def state_of(params, optimizer):
  params = jax.tree.map(jnp.array, params)  # own buffers: the step donates them
  return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))


def test_a_teacher_equal_to_the_student_adds_nothing():
  model, params = init_params(tiny_config(2))
  optimizer = make_optimizer(TrainConfig(steps=10, warmup_steps=0, lr=1e-2))
  plain_state, plain = make_train_step(model, optimizer)(state_of(params, optimizer), INPUTS, TARGETS)
  step = make_train_step(model, optimizer, teacher=(model, params), distill=2.0)
  taught_state, taught = step(state_of(params, optimizer), INPUTS, TARGETS)
  assert abs(float(taught["distill_kl"])) < 1e-6
  np.testing.assert_allclose(float(taught["loss"]), float(plain["loss"]), rtol=1e-6)
  # Adam divides each update by the gradient's running scale, so where a parameter's gradient is
  # near 0 the KL gradient's float rounding (about 1e-9, not exactly 0) moves its update by up to
  # about 1e-4 of the step size lr = 1e-2.
  for a, b in zip(jax.tree.leaves(taught_state.params), jax.tree.leaves(plain_state.params)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_teacher_pulls_the_student_towards_itself():
  """After the same steps on the same data, the distilled student is closer (in KL) to the teacher
  than one trained with a vanishing distillation weight."""
  model, params = init_params(tiny_config(2))
  _, teacher_params = init_params(tiny_config(2), seed=1)
  optimizer = make_optimizer(TrainConfig(steps=30, warmup_steps=0, lr=1e-2))
  final = {}
  for weight in (1.0, 1e-9):
    step = make_train_step(model, optimizer, teacher=(model, teacher_params), distill=weight)
    state = state_of(params, optimizer)
    for _ in range(20):
      state, metrics = step(state, INPUTS, TARGETS)
    final[weight] = float(metrics["distill_kl"])
  assert final[1.0] < 0.8 * final[1e-9]


def test_distill_needs_a_teacher(tmp_path):
  from kvjax.training import train

  config = kvjax.TrainRun(
    model=tiny_config(2, vocab_size=256),
    data=kvjax.DataConfig(max_bytes=20_000, seq_len=16),
    train=TrainConfig(steps=2, batch_size=2, warmup_steps=0, distill=0.5),
  )
  with pytest.raises(ValueError, match=r"TrainConfig.distill=0.5 needs a teacher"):
    train.run(config, tmp_path / "run")
  assert not (tmp_path / "run").exists()
  with pytest.raises(ValueError, match="TrainConfig.distill"):
    TrainConfig(distill=-1.0)
