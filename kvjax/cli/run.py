"""`kvjax run CONFIG.py`: load a config, apply overrides, save it in the workdir, run its job.

A config file defines `get_config()` returning a nested frozen dataclass with a `job` field.
Jobs in JOBS are library functions `run(config, workdir) -> dict`; any other job name is looked
up as a thin driver `experiments/<job>.py` defining `main(config, workdir)`, found in the first
folder at or above the config file's folder that has one (configs/ and experiments/ are siblings).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from kvjax.training import checkpoint
from kvjax.config import apply_overrides, config_keys, to_dict

JOBS = {
    "train": "kvjax.training.train:run",
}


def _load_module(path: Path, name: str) -> ModuleType:
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except FileNotFoundError as err:
    raise ValueError(f"no such file: {path}") from err
  return module


def load_config(path: str | Path) -> Any:
  """Runs `get_config()` of a Python config file and checks what it returns."""
  path = Path(path)
  if not path.is_file():
    raise ValueError(f"config file not found: {path}")
  module = _load_module(path, f"kvjax_config_{path.stem}")
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"config file {path} does not define get_config()")
  config = module.get_config()
  if not dataclasses.is_dataclass(config) or not isinstance(getattr(config, "job", None), str):
    raise ValueError(f"get_config() in {path} must return a config dataclass with a `job` field, got {config!r}")
  return config


def resolve_job(job: str, config_path: str | Path) -> Callable[[Any, Path], Any]:
  """The function that runs `job`: a library job from JOBS, else experiments/<job>.py:main."""
  if job in JOBS:
    module, name = JOBS[job].split(":")
    return getattr(importlib.import_module(module), name)
  start = Path(config_path).resolve().parent
  searched = [folder / "experiments" for folder in (start, *start.parents)]
  for folder in searched:
    driver = folder / f"{job}.py"
    if driver.is_file():
      module = _load_module(driver, f"kvjax_experiment_{job}")
      if not callable(getattr(module, "main", None)):
        raise ValueError(f"experiment driver {driver} does not define main(config, workdir)")
      return module.main
  raise ValueError(f"unknown job {job!r}: not a library job ({', '.join(sorted(JOBS))}) and no "
                   f"experiments/{job}.py at or above {start}")


def prepare_workdir(workdir: Path, config: Any) -> None:
  """Writes config.json, unless the workdir holds checkpoints written under an incompatible config
  (the config in the latest checkpoint's metadata is the reference)."""
  new = to_dict(config)
  if checkpoint.latest_step(workdir) is not None:
    checkpoint.check_compatible(checkpoint.read_meta(workdir)["config"], new, workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(json.dumps(new, indent=2) + "\n")


def command(args: argparse.Namespace) -> int:
  config = load_config(args.config)
  overrides = list(args.overrides)
  if args.mesh is not None:
    if "train.mesh" not in config_keys(config):
      raise ValueError(f"--mesh shards training runs, but the {config.job!r} config of {args.config} "
                       "has no train.mesh")
    overrides.append(f"train.mesh={args.mesh}")
  config = apply_overrides(config, overrides)
  job = resolve_job(config.job, args.config)
  workdir = Path(args.workdir or Path("runs") / Path(args.config).stem)
  print(json.dumps(to_dict(config), indent=2), flush=True)
  prepare_workdir(workdir, config)
  result = job(config, workdir)
  if result is not None:
    print(json.dumps(result), flush=True)
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser("run", help="run the job a config file describes (training, experiments)")
  parser.add_argument("config", help="Python file defining get_config()")
  parser.add_argument("--workdir", help="output folder (default: runs/<config file stem>)")
  parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                      help="override config fields, e.g. --set train.steps=10 model.num_kv_heads=2")
  parser.add_argument("--mesh", metavar="data=D,model=M",
                      help="shard training over a device mesh (shorthand for --set train.mesh=...): "
                           "batch on data, heads / kv heads / MLP on model")
  parser.set_defaults(func=command)
