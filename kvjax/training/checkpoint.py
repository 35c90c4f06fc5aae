"""Orbax checkpoints of a run's workdir, verified against checksums written with them.

Layout: WORKDIR/checkpoints/<step>/{params, opt_state, meta}. `params` and `opt_state` are
float32 pytrees; `meta` is JSON: {"kind": "train" | "params", "step", "config" (the run config
dict), "data" (sampler position and generator state), "corpus" (sha256 and size), "checksums",
"digest"}. A "params" checkpoint (written by save_params, e.g. for imported weights) has no
optimizer state; beside it save_params writes WORKDIR/config.json, the run config, as `kvjax run`
does.

"checksums" maps every array of the checkpoint ("params/layers_0/attn/q/kernel",
"opt_state/1/0/mu/...") to the sha256 of its dtype, shape and bytes, and "digest" is the sha256 of
the rest of the metadata, so the sampler state and the config are covered too. The metadata is an
item of the same orbax save, which commits all items at once by renaming their temporary folder:
a checkpoint is never complete without its checksums. Every restore (resuming a run, load_model for
eval, generate and uptraining) verifies them and reports a damaged checkpoint as a ValueError
"checkpoint step S of WORKDIR is damaged: WHAT", WHAT naming the array or file. Every other failure
to read a checkpoint is a ValueError naming its path; nothing here deletes a checkpoint except
CheckpointManager's keep-last-N rotation during training.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from kvjax import sharding
from kvjax.config import ModelConfig
from kvjax.fields import from_dict
from kvjax.model.params import abstract_params, check_params
from kvjax.model.transformer import Transformer
from kvjax.training import workdir as workdirs

ITEMS = ("params", "opt_state", "meta")
# Run-config keys that may change when a run is resumed: they extend or re-pace the run, or place
# it on other devices (train.mesh), without changing what any step computes beyond float rounding.
# A new train.steps is further held to check_resume's rule.
RESUMABLE_KEYS = frozenset(
  {
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.mesh",
  }
)
# The JSON files of an orbax checkpoint (of the step folder, and of each item's folder), checked
# to parse before a restore so that a damaged one is named; orbax reads some only to log a failure.
JSON_FILES = ("_CHECKPOINT_METADATA",)
ITEM_JSON_FILES = ("_METADATA", "_sharding", "array_metadatas/*", "metadata")
# How tensorstore names the array (its key, dot-joined) and the item folder it failed to read.
_TENSORSTORE_ERROR = re.compile(
  r'(?:Error reading|Metadata at) "([^"/]+)[^"]*" in OCDBT database at local file "([^"]+)"(.*)', re.S
)


def checkpoint_dir(workdir: str | Path) -> Path:
  return Path(workdir).resolve() / "checkpoints"


def step_dir(workdir: str | Path, step: int) -> Path:
  return checkpoint_dir(workdir) / str(step)


def write_atomically(path: str | Path, text: str) -> None:
  """Writes `text` to `path` through a temporary file renamed over it, so that a process killed
  at any moment leaves the old content or the new, never a part; an unchanged file is not touched."""
  path = Path(path)
  if path.is_file() and path.read_bytes() == text.encode():
    return
  tmp = path.with_name(f".{path.name}.tmp")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def open_manager(workdir: str | Path, *, keep: int | None = None, writing: bool = False) -> ocp.CheckpointManager:
  """A CheckpointManager over WORKDIR/checkpoints. Only a writer cleans up the temporary folders
  of interrupted saves, so a reader never races a training run that is saving."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep, create=writing, cleanup_tmp_directories=writing, enable_async_checkpointing=False
  )
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


def _leaf_name(path) -> str:
  """A pytree key path -> "layers_0/attn/q/kernel" (dict keys, tuple indices, field names)."""
  names = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        names.append(str(getattr(key, attr)))
        break
  return "/".join(names)


def _sha256(x) -> str:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  host = np.ascontiguousarray(np.asarray(x))
  digest = hashlib.sha256(f"{host.dtype.name}{list(host.shape)}".encode())
  digest.update(host.reshape(-1).view(np.uint8))
  return digest.hexdigest()


def array_checksums(item: str, tree) -> dict[str, str]:
  """{"item/path/of/leaf": sha256 hex of the leaf's dtype, shape and bytes} for every array of `tree`."""
  return {f"{item}/{_leaf_name(path)}": _sha256(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _digest(meta: dict) -> str:
  body = {key: value for key, value in meta.items() if key != "digest"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def with_checksums(meta: dict, **items) -> dict:
  """`meta` as saved: with the checksums of the arrays of `items` ({"params": tree, ...}) and the
  digest of it all."""
  meta = json.loads(json.dumps(meta))  # lists for tuples, as the JSON item reads back
  meta["checksums"] = {
    name: digest for item, tree in items.items() for name, digest in array_checksums(item, tree).items()
  }
  meta["digest"] = _digest(meta)
  return meta


def _damaged(workdir, step: int, what: str) -> ValueError:
  others = sorted(int(p.name) for p in checkpoint_dir(workdir).iterdir() if p.name.isdigit() and int(p.name) != step)
  also = (
    f"; the workdir also holds checkpoints of steps {others} (delete {step_dir(workdir, step)} "
    "to resume from the newest of them)"
    if others
    else ""
  )
  return ValueError(f"checkpoint step {step} of {Path(workdir).resolve()} is damaged: {what}{also}")


def _check_json_files(workdir, step: int, items) -> None:
  folder = step_dir(workdir, step)
  for pattern in JSON_FILES + tuple(f"{item}/{name}" for item in items for name in ITEM_JSON_FILES):
    for path in sorted(folder.glob(pattern)):
      try:
        json.loads(path.read_bytes())
      except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise _damaged(workdir, step, f"{path.relative_to(folder)} is not valid JSON ({err})") from None


def _read_error(err: Exception, workdir, step: int) -> ValueError:
  """The ValueError for an exception of an orbax restore: the damaged array or file when orbax or
  tensorstore names it, else the exception itself."""
  folder = step_dir(workdir, step)
  relative = lambda text: text.replace(f"{folder}/", "").replace('"', "")
  cause = err
  while cause is not None:
    text = str(cause)
    if isinstance(cause, KeyError) and (missing := re.search(r'Item "(\w+)" was not found', text)):
      return _damaged(workdir, step, f"its {missing[1]} item ({missing[1]}/) is missing")
    if isinstance(cause, FileNotFoundError) and (missing := re.search(r"File (\S+) not found", text)):
      return _damaged(workdir, step, f"{relative(missing[1])} is missing")
    if read := _TENSORSTORE_ERROR.search(text):
      status = re.match(r"([A-Z_]+): ", text)
      reason = relative(read[3].split("[tensorstore_spec")[0]).strip(": \n")
      reason = f"{status[1]}: {reason}" if status else reason
      return _damaged(
        workdir, step, f"{Path(read[2]).name}/{read[1].replace('.', '/')} cannot be read ({reason[:300]})"
      )
    cause = cause.__cause__ or cause.__context__
  first_line = (str(err).splitlines() or [""])[0][:300]
  return ValueError(f"cannot read checkpoint {folder}: {type(err).__name__}: {first_line}")


def _restore(manager: ocp.CheckpointManager, workdir, step: int, **items) -> Any:
  _check_json_files(workdir, step, items)
  try:
    return manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as err:  # orbax and tensorstore raise many types; all mean "cannot read this"
    raise _read_error(err, workdir, step) from err


def verify_arrays(workdir, step: int, meta: dict, item: str, tree) -> None:
  """Raises the damaged-checkpoint ValueError unless every array of `tree`, restored from item
  `item` of checkpoint `step`, matches the checksum its metadata `meta` records."""
  recorded = meta["checksums"]
  computed = array_checksums(item, tree)
  for name, digest in computed.items():
    if name not in recorded:
      raise _damaged(workdir, step, f"{name} has no recorded checksum")
    if recorded[name] != digest:
      raise _damaged(workdir, step, f"{name} does not match its checksum")
  unread = sorted(name for name in recorded if name.startswith(f"{item}/") and name not in computed)
  if unread:
    raise _damaged(workdir, step, f"it records arrays that were not restored ({', '.join(unread[:3])})")


def read_meta(workdir: str | Path, step: int | None = None) -> dict:
  """The JSON metadata of checkpoint `step` (default: latest), verified against its digest."""
  step = _require_step(workdir, step)
  with open_manager(workdir) as manager:
    meta = _restore(manager, workdir, step, meta=ocp.args.JsonRestore()).meta
  if not isinstance(meta, dict) or not isinstance(meta.get("checksums"), dict) or "digest" not in meta:
    raise _damaged(
      workdir,
      step,
      "meta/metadata records no checksums (it was altered, or written by a kvjax "
      "that did not checksum its checkpoints)",
    )
  if meta["digest"] != _digest(meta):
    raise _damaged(workdir, step, "meta/metadata does not match its checksum")
  if not isinstance(meta.get("config"), dict):
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
  meta = with_checksums(meta, params=params, opt_state=opt_state)
  manager.save(
    step,
    args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state), meta=ocp.args.JsonSave(meta)
    ),
  )
  manager.wait_until_finished()


def restore_train_state(
  manager: ocp.CheckpointManager, workdir, step: int, params_like, opt_state_like, mesh: Mesh | None = None
):
  """-> (params, opt_state) of checkpoint `step`, verified, shaped like the given trees, on the
  default device or sharded over `mesh` (whatever mesh, if any, the checkpoint was written from)."""
  meta = read_meta(workdir, step)
  restored = _restore(
    manager,
    workdir,
    step,
    params=ocp.args.StandardRestore(abstract(params_like, mesh)),
    opt_state=ocp.args.StandardRestore(abstract(opt_state_like, mesh)),
  )
  verify_arrays(workdir, step, meta, "params", restored.params)
  verify_arrays(workdir, step, meta, "opt_state", restored.opt_state)
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
  """ "section.field: old -> new" for every field where two nested config dicts differ."""
  old, cur = flat(saved), flat(new)
  show = lambda config, k, missing: repr(config[k]) if k in config else missing
  return [
    f"{k}: {show(old, k, '(not recorded: written before kvjax had this field)')} -> "
    f"{show(cur, k, '(no longer a field)')}"
    for k in sorted(set(old) | set(cur))
    if old.get(k) != cur.get(k) and k not in ignore
  ]


def check_compatible(saved: dict, new: dict, where: str | Path) -> None:
  """Raises ValueError unless run config `new` may resume checkpoints written under `saved`."""
  diffs = config_diffs(saved, new, RESUMABLE_KEYS)
  if diffs:
    raise ValueError(
      f"{where} holds checkpoints of a different config ({'; '.join(diffs)}); "
      "resume with the same config, or train in another --workdir"
    )


def check_resume(meta: dict, new: dict, workdir: str | Path) -> None:
  """Raises ValueError unless run config `new` may resume the checkpoint whose metadata is `meta`.

  The config must match up to RESUMABLE_KEYS. train.steps may not fall below the steps taken, and
  may change at all only while those steps lie within the warmup: the cosine decay runs over
  train.steps, so a run past its warmup trained to another length would not be the run it is.
  """
  check_compatible(meta["config"], new, workdir)
  saved, train = meta["config"].get("train", {}), new.get("train", {})
  done, steps, configured = meta.get("step"), train.get("steps"), saved.get("steps")
  if meta.get("kind") != "train" or steps is None or steps == configured:
    return
  if steps < done:
    raise ValueError(
      f"{workdir} holds a checkpoint at step {done}, past train.steps={steps}: a run cannot "
      f"be cut below the steps it has taken (kvjax eval --step reads an earlier checkpoint)"
    )
  warmup = saved.get("warmup_steps", 0)
  if done > warmup:
    kv_heads = meta["config"].get("model", {}).get("num_kv_heads")
    raise ValueError(
      f"{workdir} holds a run of train.steps={configured} at step {done}, past its {warmup} warmup steps: "
      f"its learning rate decays over those {configured} steps, and train.steps={steps} would change the "
      f"rate of every step still to come. Resume with train.steps={configured}; to train {steps} steps, "
      f"start a run with train.steps={steps} in another --workdir, or continue these weights with a fresh "
      f"optimizer and schedule: kvjax uptrain --from {workdir} --workdir NEW --kv-heads {kv_heads} "
      "--set train.steps=N"
    )


def load_model(
  workdir: str | Path, step: int | None = None, *, mesh: Mesh | None = None
) -> tuple[Transformer, Any, dict]:
  """Latest (or given) checkpoint of a workdir -> (model, verified params, run config dict).
  Params only, on the default device or sharded over `mesh`."""
  step = _require_step(workdir, step)
  meta = read_meta(workdir, step)
  config = meta["config"]
  try:
    model_config = from_dict(ModelConfig, config.get("model"))
  except ValueError as err:
    raise ValueError(f"checkpoint {step_dir(workdir, step)} has an invalid model config: {err}") from err
  model = Transformer(model_config)
  with open_manager(workdir) as manager:
    target = abstract(abstract_params(model_config), mesh)
    params = _restore(manager, workdir, step, params=ocp.args.StandardRestore(target)).params
  verify_arrays(workdir, step, meta, "params", params)
  return model, params, config


def save_params(
  workdir: str | Path, params, model_config: ModelConfig, *, step: int = 0, run_config: dict | None = None
) -> Path:
  """Writes `params` as a checkpoint that load_model (and so `kvjax eval` / `generate`) reads.

  run_config defaults to {"job": "import", "model": model_config.to_dict()} and is also written to
  WORKDIR/config.json (first, so that a checkpoint never lacks it), so that every workdir names
  its model in plain JSON (the kv-size planner reads it without orbax). Refuses a workdir that
  already holds checkpoints; claims the workdir (kvjax.training.workdir) as one of run_config's
  job, so it writes only into a new or empty one, or one of that job. Returns the checkpoint's path.
  """
  if latest_step(workdir) is not None:
    raise ValueError(
      f"{checkpoint_dir(workdir)} already holds checkpoints; save into a new workdir rather than overwrite them"
    )
  check_params(params, model_config)
  config = dict(run_config) if run_config is not None else {"job": "import"}
  config["model"] = model_config.to_dict()
  meta = with_checksums({"kind": "params", "step": step, "config": config}, params=params)
  with workdirs.claim(workdir, config["job"], {"config": config}):  # a workdir of its job's kind
    write_atomically(Path(workdir) / "config.json", json.dumps(config, indent=2) + "\n")
    with open_manager(workdir, writing=True) as manager:
      manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)))
      manager.wait_until_finished()
  return step_dir(workdir, step)
