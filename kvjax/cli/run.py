"""`kvjax run CONFIG.py`: load a config, apply overrides, save it in the workdir, run its job.

A config file defines `get_config()` returning a nested frozen dataclass with a `job` field. A
library job (JOBS) runs by that name: a function `run(config, workdir) -> dict`. Any other job
is run by the driver the config file names in a module-level DRIVER, the path of a Python file
defining `main(config, workdir)`; a relative DRIVER is taken from the config file's folder. The
configs under configs/ name theirs from their own location:

  DRIVER = Path(__file__).parents[2] / "experiments" / "gqa_table.py"

so a config runs the same from any working directory. A config file that names a DRIVER runs it,
whatever its job field says.

The workdir is claimed (kvjax.training.workdir) before anything is written into it and held
until the job ends: a library job's workdir by that job's rule (a training run's: empty, or
holding a run this config may resume), a driver's as a study's (empty, or holding a study of
the same config class).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ContextManager

from kvjax.cli import options
from kvjax.fields import apply_overrides, config_keys, to_dict
from kvjax.training import checkpoint, train
from kvjax.training.config import TrainRun
from kvjax.training import workdir as workdirs

JOBS = {
  "train": "kvjax.training.train:run",
}
# How a library job claims its workdir: claim(config, workdir) -> a context manager.
CLAIMS = {
  "train": "kvjax.training.train:claim_workdir",
}


def _function(spec: str) -> Callable:
  module, name = spec.split(":")
  return getattr(importlib.import_module(module), name)


def _load_module(path: Path, name: str, what: str) -> ModuleType:
  """The module of the Python file `path`, refused with a ValueError naming it as `what` when it is
  not one (another kind of file, or text that does not parse). An exception its code raises is
  its own and keeps its traceback."""
  spec = importlib.util.spec_from_file_location(name, path) if path.suffix == ".py" else None
  if spec is None:
    raise ValueError(f"{what} {path} is not a Python file (.py)")
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as err:
    if err.filename not in (None, str(path)):  # a module it imports
      raise
    where = f" (line {err.lineno})" if err.lineno else ""
    raise ValueError(f"{what} {path} is not valid Python: {err.msg}{where}") from None
  return module


def _load(path: Path) -> tuple[Any, Path | None]:
  """(get_config() of the config file, the DRIVER it names resolved to an absolute path, or None)."""
  if not path.is_file():
    raise ValueError(f"config file not found: {path}")
  module = _load_module(path, f"kvjax_config_{path.stem}", "config file")
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"config file {path} does not define get_config()")
  config = module.get_config()
  if not dataclasses.is_dataclass(config) or not isinstance(getattr(config, "job", None), str):
    raise ValueError(f"get_config() in {path} must return a config dataclass with a `job` field, got {config!r}")
  driver = getattr(module, "DRIVER", None)
  if driver is None:
    return config, None
  if not isinstance(driver, (str, os.PathLike)):
    raise ValueError(f"DRIVER in config file {path} must be a path, got {driver!r}")
  return config, (path.resolve().parent / driver).resolve()


def load_config(path: str | Path) -> Any:
  """Runs `get_config()` of a Python config file and checks what it returns."""
  return _load(Path(path))[0]


def resolve_job(job: str, driver: Path | None, config_path: str | Path) -> Callable[[Any, Path], Any]:
  """The function that runs the config of `config_path`: main() of its `driver` file when it names
  one, else the library job `job` from JOBS."""
  if driver is not None:
    if not driver.is_file():
      raise ValueError(f"config file {config_path} names DRIVER {driver}, which does not exist")
    module = _load_module(driver, f"kvjax_driver_{driver.stem}", f"driver (DRIVER of {config_path})")
    if not callable(getattr(module, "main", None)):
      raise ValueError(f"driver {driver} (DRIVER of {config_path}) does not define main(config, workdir)")
    return module.main
  if job in JOBS:
    return _function(JOBS[job])
  raise ValueError(
    f"unknown job {job!r}: not a library job ({', '.join(sorted(JOBS))}), and config file "
    f"{config_path} names no DRIVER (the path of a file defining main(config, workdir))"
  )


def claim_workdir(workdir: Path, config: Any, driver: Path | None) -> ContextManager[Path]:
  """The claim of `workdir` for the job of `config` (see the module docstring)."""
  if driver is None and config.job in CLAIMS:
    return _function(CLAIMS[config.job])(config, workdir)
  return workdirs.claim_study(workdir, config)


def prepare_workdir(workdir: Path, config: Any) -> None:
  """Writes the resolved config to config.json in the claimed workdir (the claim has checked that
  this config may run there: a training run's, against the config of its latest checkpoint)."""
  checkpoint.write_atomically(workdir / "config.json", json.dumps(to_dict(config), indent=2) + "\n")


def command(args: argparse.Namespace) -> int:
  config, driver = _load(Path(args.config))
  config = options.apply_set(config, args)
  if args.mesh is not None:
    if "train.mesh" not in config_keys(config):
      raise ValueError(f"--mesh shards training runs, but the {config.job!r} config of {args.config} has no train.mesh")
    config = apply_overrides(config, [f"train.mesh={args.mesh}"])
  job = resolve_job(config.job, driver, args.config)
  workdir = Path(args.workdir) if args.workdir is not None else Path("runs") / Path(args.config).stem
  print(json.dumps(to_dict(config), indent=2), flush=True)
  if isinstance(config, TrainRun):  # a run the memory cannot hold is refused before its workdir is touched
    train.check_memory(config)
  with claim_workdir(workdir, config, driver):
    prepare_workdir(workdir, config)
    result = job(config, workdir)
  if result is not None:
    print(json.dumps(result), flush=True)
  return 0


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser(
    "run",
    help="run the job a config file describes (training, experiments)",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "config", type=options.path_text, help="Python file defining get_config() (and DRIVER, for an experiment)"
  )
  parser.add_argument(
    "--workdir",
    type=options.workdir_text,
    help="output folder: new, empty or a kvjax workdir of this job (default: runs/<config stem>)",
  )
  options.add_set_option(parser)
  options.add_mesh_option(parser)
  parser.set_defaults(func=command)
