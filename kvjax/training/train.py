"""A training run: the train step (kvjax.training.step: AdamW with warmup and cosine decay) over
the corpus' batches, logged metrics, periodic held-out eval and orbax checkpoints from which a run
resumes exactly.

Batches are int32 [B, T] inputs and targets (the inputs shifted by one token: a byte, or an id of
the workdir's tokenizer.json when it holds one, as an imported model's uptraining does). The
run's memory need is checked against the machine's (kvjax.memory) before anything is allocated.
The train state (step, float32 params, optimizer state) is donated to every step. A checkpoint
holds the state, the data sampler's position and generator state, the run config and the corpus
hash, so a run killed at any point and started again ends with bitwise the parameters of an
uninterrupted run (on the same machine and backend).

With TrainConfig.mesh the state is sharded by kvjax.sharding's rules (initialised, or restored
from a checkpoint, straight onto the mesh) and every batch is split over `data`; jit then
partitions the one train step. A run may resume on another mesh, or none.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from kvjax import memory, sharding
from kvjax.interop.tokenizer import TextTokenizer
from kvjax.training import checkpoint
from kvjax.training import workdir as workdirs
from kvjax.training.data import Dataset, WindowSampler, load_dataset
from kvjax.training.evaluate import evaluate
from kvjax.model.flops import peak_flops, train_flops_per_token
from kvjax.model.transformer import Transformer
from kvjax.training.config import TrainRun, to_dict
from kvjax.training.step import (
  TrainState,
  init_state,
  learning_rate_schedule,
  make_optimizer,
  make_train_step,
  place_state,
)

__all__ = ["TrainingDiverged", "check_memory", "claim_workdir", "run"]


class TrainingDiverged(ValueError):
  """A non-finite loss or gradient norm. A ValueError, so `kvjax run` reports it as a clean error."""


class Logger:
  """Appends JSON lines to WORKDIR/metrics.jsonl. A run resumed at step S first drops the lines
  past S (written by the interrupted run after its last checkpoint, or cut short by the kill),
  rewriting the file atomically, so that it reads as one run; a fresh run starts it empty."""

  def __init__(self, workdir: Path, resume_step: int):
    self.path = workdir / "metrics.jsonl"
    kept = []
    if resume_step and self.path.exists():
      for line in self.path.read_text().splitlines():
        try:
          if json.loads(line)["step"] <= resume_step:
            kept.append(line)
        except (ValueError, KeyError, TypeError):
          pass  # a line cut short by the interruption
    if kept or self.path.exists():
      checkpoint.write_atomically(self.path, "".join(f"{line}\n" for line in kept))

  def write(self, record: dict) -> None:
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")


def _resume(workdir: Path, config: dict, data: Dataset, like: TrainState, sampler: WindowSampler, mesh: Mesh | None):
  """Restores the latest checkpoint into (state, sampler) -> (state, step); (None, 0) when none.
  `like` gives the state's structure, shapes and dtypes; the state is restored onto `mesh`.
  Only reads: a refused resume leaves the workdir as it was."""
  step = checkpoint.latest_step(workdir)
  if step is None:
    return None, 0
  where = checkpoint.step_dir(workdir, step)
  meta = checkpoint.read_meta(workdir, step)
  if meta.get("kind") != "train":
    raise ValueError(
      f"checkpoint {where} holds {meta.get('kind')!r} weights without optimizer state "
      "and cannot be resumed; train in a new --workdir"
    )
  checkpoint.check_resume(meta, config, workdir)
  saved_hash = meta.get("corpus", {}).get("sha256")
  if saved_hash != data.info.sha256:
    raise ValueError(
      f"checkpoint {where} was trained on a corpus with sha256 {saved_hash}, but "
      f"{data.info.source} now has sha256 {data.info.sha256}; resuming would not be "
      "exact - train in another --workdir"
    )
  with checkpoint.open_manager(workdir) as manager:
    params, opt_state = checkpoint.restore_train_state(manager, workdir, step, like.params, like.opt_state, mesh)
  try:
    sampler.restore(meta["data"])
  except (KeyError, TypeError, ValueError) as err:
    raise ValueError(f"checkpoint {where} holds no valid data position: {err!r}") from err
  return place_state(TrainState(step=np.int32(step), params=params, opt_state=opt_state), mesh), step


def claim_workdir(config: TrainRun, workdir: str | Path):
  """kvjax.training.workdir.claim of `workdir` for the run `config`, a context manager. Its kind is
  the config's job ("train"; "uptrain" for kvjax uptrain). A marked workdir of that kind is taken
  when it holds no checkpoint yet or its latest checkpoint's config is one this run may resume
  (checkpoint.check_resume)."""
  config_dict = to_dict(config)

  def same_job(_recorded: dict) -> None:
    if checkpoint.latest_step(workdir) is not None:
      checkpoint.check_resume(checkpoint.read_meta(workdir), config_dict, Path(workdir).resolve())

  return workdirs.claim(workdir, config.job, {"config": config_dict}, same_job=same_job)


def run(config: TrainRun, workdir: str | Path, init_params=None, teacher=None) -> dict:
  """Trains (or resumes) the run in `workdir`, claimed (claim_workdir) for the whole run; returns
  a summary of the final step. A fresh run starts from `init_params` (with fresh optimizer state)
  when given, as uptraining does; a resumed run always continues from its checkpoint.

  Resuming: the latest checkpoint is verified (checkpoint.check_resume, its checksums) before
  anything is written. train.steps may not fall below the steps taken, nor change once they pass
  the warmup (the cosine decay spans train.steps; extend by a new run, or by uptraining the
  weights); a finished run is evaluated and nothing is written. The first metrics line after a
  resume averages only the steps since the checkpoint, as its "steps_averaged" says.

  TrainConfig.distill > 0 needs `teacher`, a (model, params) pair whose next-token distributions
  the run learns from besides the data (kvjax uptrain passes its source)."""
  if config.train.distill > 0 and teacher is None:
    raise ValueError(
      f"TrainConfig.distill={config.train.distill} needs a teacher model "
      "(kvjax uptrain --distill uses the source model)"
    )
  check_memory(config, init_params)  # before the workdir is claimed: a refusal writes nothing
  with claim_workdir(config, workdir) as path:
    return _run(config, path, init_params, teacher)


def check_memory(config: TrainRun, init_params=None) -> None:
  """Refuses, from the config alone (nothing traced or allocated), a run that the memory of this
  machine, or of the run's mesh, cannot hold (kvjax.memory.check_training)."""
  mesh = sharding.mesh_from_spec(config.train.mesh)
  resident = sum(x.nbytes for x in jax.tree.leaves(init_params) if isinstance(x, jax.Array))
  memory.check_training(
    config.model,
    config.train.batch_size,
    config.data.seq_len,
    resident=resident,
    devices=None if mesh is None else list(mesh.devices.flat),
  )


def _run(config: TrainRun, workdir: Path, init_params, teacher=None) -> dict:
  tc, config_dict = config.train, to_dict(config)
  mesh = sharding.mesh_from_spec(tc.mesh)  # first: a mesh this machine cannot hold stops the run here
  data = load_dataset(config.data, TextTokenizer.load(workdir, config.model.vocab_size))
  model = Transformer(config.model)
  compute_model = Transformer(config.model.replace(dtype="bfloat16")) if tc.bf16 else model
  optimizer = make_optimizer(tc)
  sampler = WindowSampler(data.train, data.seq_len, tc.batch_size, config.data.seed)
  key = jax.random.key(tc.seed)
  like = jax.eval_shape(functools.partial(init_state, model, optimizer), key)
  num_params = sum(x.size for x in jax.tree.leaves(like.params))

  state, start = _resume(workdir, config_dict, data, like, sampler, mesh)
  about = (
    f"kvjax train: {num_params:,} parameters, corpus {data.info.source} ({data.info.num_bytes:,} bytes, "
    f"{data.info.num_files} files), "
  )
  if start == tc.steps:  # finished: evaluated again, nothing written
    print(about + f"finished at step {start}; nothing to train", flush=True)
    val = evaluate(compute_model, state.params, data, batch_size=tc.batch_size, num_batches=tc.eval_batches, mesh=mesh)
    return {
      "step": start,
      "val_loss": val["loss"],
      "bits_per_byte": val["bits_per_byte"],
      "accuracy": val["accuracy"],
      "tokens_per_s": None,
      "mfu": None,
      "peak_flops_source": None,
      "params": num_params,
    }
  manager = checkpoint.open_manager(workdir, keep=tc.keep_checkpoints, writing=True)
  try:
    if state is None:
      state = init_state(model, optimizer, key, init_params, mesh)
    checkpoint.write_atomically(workdir / "corpus.json", json.dumps(data.info.to_dict(), indent=2) + "\n")
    print(
      about
      + (f"resuming at step {start}" if start else "starting at step 0")
      + (f", on a mesh of {dict(mesh.shape)}" if mesh is not None else ""),
      flush=True,
    )
    state_sharding = sharding.param_sharding(like, mesh) if mesh is not None else None
    trainer = _Trainer(
      config, workdir, manager, compute_model, optimizer, data, sampler, start, mesh, state_sharding, like, teacher
    )
    return trainer.loop(state, start) | {"params": num_params}
  finally:
    manager.close()


class _Trainer:
  """The training loop's bookkeeping: logging windows, throughput, eval and checkpoint cadence."""

  def __init__(
    self,
    config: TrainRun,
    workdir: Path,
    manager,
    model,
    optimizer,
    data,
    sampler,
    start,
    mesh,
    state_sharding,
    like: TrainState,
    teacher=None,
  ):
    self.config, self.tc, self.workdir, self.manager = config, config.train, workdir, manager
    self.like = like  # the state's structure, for reading a checkpoint back
    self.model, self.data, self.sampler, self.mesh = model, data, sampler, mesh
    self.train_step = make_train_step(model, optimizer, state_sharding, teacher=teacher, distill=self.tc.distill)
    self.schedule = jax.jit(learning_rate_schedule(self.tc))
    self.logger = Logger(workdir, start)
    self.tokens_per_step = self.tc.batch_size * data.seq_len
    self.flops_per_step = train_flops_per_token(config.model, data.seq_len) * self.tokens_per_step
    self.peak, self.peak_source = peak_flops()
    if self.peak is not None and mesh is not None:
      self.peak *= mesh.size  # peak_flops is one device's
    self.pending: list[tuple[int, dict]] = []  # device metrics not yet checked
    self.window = self._new_window()
    self.timed_steps, self.timed_seconds = 0, 0.0
    self.val: dict = {}

  def loop(self, state: TrainState, start: int) -> dict:
    tc = self.tc
    bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", mininterval=1.0)
    clock = time.perf_counter()
    try:
      for step in range(start + 1, tc.steps + 1):
        inputs, targets = self.sampler.next()
        if self.mesh is not None:
          inputs, targets = sharding.shard_batch(self.mesh, inputs, targets)
        state, metrics = self.train_step(state, inputs, targets)
        self.pending.append((step, metrics))
        bar.update(1)
        flush = step % tc.log_every == 0 or step % tc.checkpoint_every == 0 or step % tc.eval_every == 0
        if not (flush or step == tc.steps or step == start + 1):
          continue
        checked = self._check_pending()
        if step > start + 1:  # the first step compiles: it is not counted in throughput
          self.window["timed_steps"] += checked
          self.window["seconds"] += time.perf_counter() - clock
        if step % tc.log_every == 0 or step == tc.steps:
          self._log(step, bar)
        if step % tc.eval_every == 0 or step == tc.steps:
          self._eval(step, state)
        if step % tc.checkpoint_every == 0 or step == tc.steps:
          self._save(step, state)
        clock = time.perf_counter()
    finally:
      bar.close()
    tokens_per_s = self.timed_steps * self.tokens_per_step / self.timed_seconds if self.timed_seconds else None
    return {
      "step": int(state.step),
      "val_loss": self.val["loss"],
      "bits_per_byte": self.val["bits_per_byte"],
      "accuracy": self.val["accuracy"],
      "tokens_per_s": tokens_per_s,
      "mfu": self._mfu(tokens_per_s),
      "peak_flops_source": self.peak_source,
    }

  def _mfu(self, tokens_per_s: float | None) -> float | None:
    if tokens_per_s is None or self.peak is None:
      return None
    return tokens_per_s / self.tokens_per_step * self.flops_per_step / self.peak

  @staticmethod
  def _new_window() -> dict:
    return {"steps": 0, "loss": 0.0, "grad_norm": 0.0, "timed_steps": 0, "seconds": 0.0}

  def _check_pending(self) -> int:
    """Fetches the metrics of the steps since the last check; stops on a non-finite value.
    Returns how many steps were checked."""
    for step, metrics in self.pending:
      loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
      if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingDiverged(
          f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; "
          f"stopped, {self._last_good()}. Lower train.lr or raise train.warmup_steps."
        )
      self.window["steps"] += 1
      self.window["loss"] += loss
      self.window["grad_norm"] += grad_norm
    checked, self.pending = len(self.pending), []
    return checked

  def _last_good(self) -> str:
    """Names the newest checkpoint if it reads back verified and finite, else says why none is good."""
    step = self.manager.latest_step()
    if step is None:
      return "no checkpoint was written"
    try:
      params, opt_state = checkpoint.restore_train_state(
        self.manager, self.workdir, step, self.like.params, self.like.opt_state, self.mesh
      )
    except ValueError as err:
      return f"and no checkpoint is good: {err}"
    if not all(np.isfinite(x).all() for x in jax.tree.leaves((params, opt_state))):
      return f"and no checkpoint is good: {checkpoint.step_dir(self.workdir, step)} holds non-finite values"
    return f"the last good checkpoint (verified) is {checkpoint.step_dir(self.workdir, step)}"

  def _log(self, step: int, bar: tqdm) -> None:
    w = self.window
    if not w["steps"]:
      return
    tokens_per_s = w["timed_steps"] * self.tokens_per_step / w["seconds"] if w["seconds"] else None
    # steps_averaged is log_every but in a window cut short: the first after a resume from a
    # checkpoint between log steps, or the last, at a train.steps that is not a multiple of it.
    record = {
      "step": step,
      "kind": "train",
      "loss": w["loss"] / w["steps"],
      "steps_averaged": w["steps"],
      "grad_norm": w["grad_norm"] / w["steps"],
      "lr": float(self.schedule(step - 1)),
      "tokens_per_s": tokens_per_s,
      "mfu": self._mfu(tokens_per_s),
    }
    self.logger.write(record)
    postfix = {"loss": f"{record['loss']:.3f}"}
    if tokens_per_s:
      postfix |= {"tok/s": f"{tokens_per_s:,.0f}", "mfu": f"{record['mfu']:.1%}" if record["mfu"] is not None else "?"}
      self.timed_steps += w["timed_steps"]
      self.timed_seconds += w["seconds"]
    bar.set_postfix(postfix, refresh=False)
    self.window = self._new_window()

  def _eval(self, step: int, state: TrainState) -> None:
    self.val = evaluate(
      self.model,
      state.params,
      self.data,
      batch_size=self.tc.batch_size,
      num_batches=self.tc.eval_batches,
      mesh=self.mesh,
    )
    self.logger.write({"step": step, "kind": "eval", **{f"val_{k}": v for k, v in self.val.items()}})
    tqdm.write(
      f"step {step}: val loss {self.val['loss']:.4f}, {self.val['bits_per_byte']:.3f} bits/byte, "
      f"accuracy {self.val['accuracy']:.3f}"
    )

  def _save(self, step: int, state: TrainState) -> None:
    meta = {
      "kind": "train",
      "step": step,
      "config": to_dict(self.config),
      "data": self.sampler.state(),
      "corpus": self.data.info.to_dict(),
    }
    checkpoint.save_train_state(self.manager, step, state.params, state.opt_state, meta)
