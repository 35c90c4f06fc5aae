"""Orbax checkpoints of a run's workdir.

Layout: WORKDIR/checkpoints/<step>/{params, opt_state, meta}. `params` and `opt_state` are
float32 pytrees; `meta` is JSON: {"kind": "train" | "params", "step", "config" (the run config
dict), "data" (sampler position and generator state), "corpus" (sha256 and size)}. A "params"
checkpoint (written by save_params, e.g. for imported weights) has no optimizer state; beside it
save_params writes WORKDIR/config.json, the run config, as `kvjax run` does.

Every failure to read a checkpoint is a ValueError naming its path; nothing here deletes a
checkpoint except CheckpointManager's keep-last-N rotation during training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from kvjax import sharding
from kvjax.config import ModelConfig, from_dict
from kvjax.model.params import abstract_params, check_params
from kvjax.model.transformer import Transformer

ITEMS = ("params", "opt_state", "meta")
# Run-config keys that may change when a run is resumed: they extend or re-pace the run, or place
# it on other devices (train.mesh), without changing what any step computes beyond float rounding.
RESUMABLE_KEYS = frozenset({"train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
                            "train.checkpoint_every", "train.keep_checkpoints", "train.mesh"})


def checkpoint_dir(workdir: str | Path) -> Path:
  return Path(workdir).resolve() / "checkpoints"


def step_dir(workdir: str | Path, step: int) -> Path:
  return checkpoint_dir(workdir) / str(step)


def open_manager(workdir: str | Path, *, keep: int | None = None, writing: bool = False) -> ocp.CheckpointManager:
  """A CheckpointManager over WORKDIR/checkpoints. Only a writer cleans up the temporary folders
  of interrupted saves, so a reader never races a training run that is saving."""
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=writing, cleanup_tmp_directories=writing,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(checkpoint_dir(workdir), item_names=ITEMS, options=options)


def latest_step(workdir: str | Path) -> int | None:
  """The newest complete checkpoint's step, or None when the workdir has none."""
  if not checkpoint_dir(workdir).is_dir():
    return None
  with open_manager(workdir) as manager:
    return manager.latest_step()


def abstract(tree: Any, mesh: Mesh | None = None) -> Any:
  """Arrays (or ShapeDtypeStructs) -> ShapeDtypeStructs on the default device, or placed on `mesh`
  by kvjax.sharding's rules: a restore target (orbax reads each device's shard straight there)."""
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, tree)
  else:
    shardings = sharding.param_sharding(tree, mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _restore(manager: ocp.CheckpointManager, workdir, step: int, **items) -> Any:
  try:
    return manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as err:  # orbax and tensorstore raise many types; all mean "cannot read this"
    raise ValueError(f"cannot read checkpoint {step_dir(workdir, step)}: {type(err).__name__}: {err}") from err


def read_meta(workdir: str | Path, step: int | None = None) -> dict:
  """The JSON metadata of checkpoint `step` (default: latest)."""
  step = _require_step(workdir, step)
  with open_manager(workdir) as manager:
    meta = _restore(manager, workdir, step, meta=ocp.args.JsonRestore()).meta
  if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
    raise ValueError(f"checkpoint {step_dir(workdir, step)} has no run config in its metadata")
  return meta


def _require_step(workdir, step: int | None) -> int:
  """`step` (default: the latest), checked to exist."""
  if not checkpoint_dir(workdir).is_dir():
    raise ValueError(f"no checkpoint found in {checkpoint_dir(workdir)}")
  with open_manager(workdir) as manager:
    steps = list(manager.all_steps())
  if not steps:
    raise ValueError(f"no checkpoint found in {checkpoint_dir(workdir)}")
  if step is None:
    return max(steps)
  if step not in steps:
    raise ValueError(f"no checkpoint at step {step} in {checkpoint_dir(workdir)}; it holds steps {sorted(steps)}")
  return step


def save_train_state(manager: ocp.CheckpointManager, step: int, params, opt_state, meta: dict) -> None:
  manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                             opt_state=ocp.args.StandardSave(opt_state),
                                             meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()


def restore_train_state(manager: ocp.CheckpointManager, workdir, step: int, params_like, opt_state_like,
                        mesh: Mesh | None = None):
  """-> (params, opt_state) of checkpoint `step`, shaped like the given trees, on the default device
  or sharded over `mesh` (whatever mesh, if any, the checkpoint was written from)."""
  restored = _restore(manager, workdir, step, params=ocp.args.StandardRestore(abstract(params_like, mesh)),
                      opt_state=ocp.args.StandardRestore(abstract(opt_state_like, mesh)))
  return restored.params, restored.opt_state


def flat(config: dict, prefix: str = "") -> dict:
  """Nested dict -> {"section.field": value}."""
  out = {}
  for key, value in config.items():
    if isinstance(value, dict):
      out.update(flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def config_diffs(saved: dict, new: dict, ignore=frozenset()) -> list[str]:
  """"section.field: old -> new" for every field where two nested config dicts differ."""
  old, cur = flat(saved), flat(new)
  show = lambda config, k, missing: repr(config[k]) if k in config else missing
  return [f"{k}: {show(old, k, '(not recorded: written before kvjax had this field)')} -> "
          f"{show(cur, k, '(no longer a field)')}" for k in sorted(set(old) | set(cur))
          if old.get(k) != cur.get(k) and k not in ignore]


def check_compatible(saved: dict, new: dict, where: str | Path) -> None:
  """Raises ValueError unless run config `new` may resume checkpoints written under `saved`."""
  diffs = config_diffs(saved, new, RESUMABLE_KEYS)
  if diffs:
    raise ValueError(f"{where} holds checkpoints of a different config ({'; '.join(diffs)}); "
                     "resume with the same config, or train in another --workdir")


def load_model(workdir: str | Path, step: int | None = None, *,
               mesh: Mesh | None = None) -> tuple[Transformer, Any, dict]:
  """Latest (or given) checkpoint of a workdir -> (model, params, run config dict). Params only,
  on the default device or sharded over `mesh`."""
  step = _require_step(workdir, step)
  config = read_meta(workdir, step)["config"]
  try:
    model_config = from_dict(ModelConfig, config.get("model"))
  except ValueError as err:
    raise ValueError(f"checkpoint {step_dir(workdir, step)} has an invalid model config: {err}") from err
  model = Transformer(model_config)
  with open_manager(workdir) as manager:
    target = abstract(abstract_params(model_config), mesh)
    params = _restore(manager, workdir, step, params=ocp.args.StandardRestore(target)).params
  return model, params, config


def save_params(workdir: str | Path, params, model_config: ModelConfig, *, step: int = 0,
                run_config: dict | None = None) -> Path:
  """Writes `params` as a checkpoint that load_model (and so `kvjax eval` / `generate`) reads.

  run_config defaults to {"job": "import", "model": model_config.to_dict()} and is also written to
  WORKDIR/config.json, so that every workdir names its model in plain JSON (the kv-size planner
  reads it without orbax). Refuses a workdir that already holds checkpoints. Returns the
  checkpoint's path.
  """
  if latest_step(workdir) is not None:
    raise ValueError(f"{checkpoint_dir(workdir)} already holds checkpoints; "
                     "save into a new workdir rather than overwrite them")
  check_params(params, model_config)
  config = dict(run_config) if run_config is not None else {"job": "import"}
  config["model"] = model_config.to_dict()
  meta = {"kind": "params", "step": step, "config": config}
  with open_manager(workdir, writing=True) as manager:
    manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                               meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
  (Path(workdir) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  return step_dir(workdir, step)
