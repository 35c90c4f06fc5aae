"""`kvjax run CONFIG.py`: load a config, apply overrides, save it in the workdir, run its job.

A config file defines `get_config()` returning a frozen config dataclass whose `job` field names
what runs it:
  - a study: the module kvjax/studies/<job>.py, whose entry point
    `run(study, workdir, progress) -> rows` writes its report into the workdir through
    kvjax.studies.base.report (WORKDIR/<job>.md, .csv, .json and its figures) and returns the rows;
  - the library job "train" (kvjax.training.train), which trains a model in the workdir.
Configs live in configs/<job>/<name>.py, and a run's default workdir is runs/<job>_<name>.

A study reports the progress of its stages on stderr (its training logs too); stdout gets only
its table, WORKDIR/<job>.md, once it has finished; every row is in WORKDIR/<job>.json. A training
run logs on stdout. The resolved config is saved as WORKDIR/config.json.

The workdir is claimed (kvjax.training.workdir) before anything is written into it and held
until the job ends: a training run's by train's rule (empty, or holding a run this config may
resume), a study's as a study's (empty, or holding a study of the same config class).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager

import kvjax
from kvjax.cli import options
from kvjax.fields import apply_overrides, config_keys, to_dict
from kvjax.studies import JOBS
from kvjax.training import checkpoint, train
from kvjax.training.config import TrainRun
from kvjax.training import workdir as workdirs

STUDIES = Path(__file__).resolve().parents[1] / "studies"
CONFIGS = Path(kvjax.__file__).resolve().parents[1] / "configs"
# A job's runner: run(config, workdir, progress) -> rows (a list of dicts) or a summary.
Runner = Callable[[Any, Path, Callable[[str], None]], Any]


def _train(config: TrainRun, workdir: Path, progress: Callable[[str], None]) -> dict:
  return train.run(config, workdir)


# The library jobs: (runner, claim(config, workdir) -> a context manager, description).
LIBRARY_JOBS = {
  "train": (_train, train.claim_workdir, "train a model from scratch (kvjax.training.train)"),
}


def study_modules() -> dict[str, str]:
  """{job: the first line of its docstring} of every study job (kvjax.studies.JOBS), read from
  the source, so that listing imports nothing."""
  found = {}
  for job in JOBS:
    path = STUDIES / f"{job}.py"
    found[job] = (ast.get_docstring(ast.parse(path.read_text(), str(path))) or "").strip().split("\n")[0]
  return found


def configs_of(job: str) -> list[Path]:
  """The config files of `job`: configs/<job>/*.py, where the source tree has them."""
  return sorted((CONFIGS / job).glob("*.py"))


def _load_module(path: Path, name: str, what: str):
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


def load_config(path: str | Path) -> Any:
  """Runs `get_config()` of a Python config file and checks what it returns."""
  path = Path(path)
  if not path.is_file():
    raise ValueError(f"config file not found: {path}")
  module = _load_module(path, f"kvjax_config_{path.stem}", "config file")
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"config file {path} does not define get_config()")
  config = module.get_config()
  if not dataclasses.is_dataclass(config) or not isinstance(getattr(config, "job", None), str):
    raise ValueError(f"get_config() in {path} must return a config dataclass with a `job` field, got {config!r}")
  return config


def resolve_job(job: str, config_path: str | Path) -> Runner:
  """The runner of `job`: a library job's, or run() of the study module kvjax/studies/<job>.py."""
  if job in LIBRARY_JOBS:
    return LIBRARY_JOBS[job][0]
  if job in study_modules():
    return importlib.import_module(f"kvjax.studies.{job}").run
  raise ValueError(
    f"unknown job {job!r} in config file {config_path}: not a study ({', '.join(sorted(study_modules()))}) "
    f"nor a library job ({', '.join(LIBRARY_JOBS)})"
  )


def claim_workdir(workdir: Path, config: Any) -> ContextManager[Path]:
  """The claim of `workdir` for the job of `config` (see the module docstring)."""
  if config.job in LIBRARY_JOBS:
    return LIBRARY_JOBS[config.job][1](config, workdir)
  return workdirs.claim_study(workdir, config)


def prepare_workdir(workdir: Path, config: Any) -> None:
  """Writes the resolved config to config.json in the claimed workdir (the claim has checked that
  this config may run there: a training run's, against the config of its latest checkpoint)."""
  checkpoint.write_atomically(workdir / "config.json", json.dumps(to_dict(config), indent=2) + "\n")


def default_workdir(config: Any, config_path: str | Path) -> Path:
  """runs/<job>_<config file's stem>: one per config, as configs/<job>/ holds each name once."""
  return Path("runs") / f"{config.job}_{Path(config_path).stem}"


def progress(message: str) -> None:
  """A study's progress: one line on stderr."""
  print(message, file=sys.stderr, flush=True)


def command(args: argparse.Namespace) -> int:
  config = options.apply_set(load_config(args.config), args)
  if args.mesh is not None:
    if "train.mesh" not in config_keys(config):
      raise ValueError(f"--mesh shards training runs, but the {config.job!r} config of {args.config} has no train.mesh")
    config = apply_overrides(config, [f"train.mesh={args.mesh}"])
  if isinstance(config, TrainRun) and config.job != "train":
    raise ValueError(f"the TrainRun of config file {args.config} runs as job 'train', got job={config.job!r}")
  job = resolve_job(config.job, args.config)
  workdir = Path(args.workdir) if args.workdir is not None else default_workdir(config, args.config)
  if isinstance(config, TrainRun):  # a run the memory cannot hold is refused before its workdir is touched
    train.check_memory(config)
  study = config.job not in LIBRARY_JOBS
  with claim_workdir(workdir, config):
    prepare_workdir(workdir, config)
    # A study's stdout is its table alone: whatever it prints on the way goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if study else contextlib.nullcontext():
      result = job(config, workdir, progress)
  table = workdir / f"{config.job}.md"
  if study and table.is_file():
    print(table.read_text(), end="", flush=True)
  elif not study:  # a training run ends with its final metrics, one JSON line
    print(json.dumps(result), flush=True)
  return 0


def jobs_help() -> str:
  """The epilog of `kvjax run --help`: every job, one line each, and its configs."""
  lines = ["jobs (the `job` of a config; its configs):"]
  described = {**{job: text for job, (_, _, text) in LIBRARY_JOBS.items()}, **study_modules()}
  for job, text in described.items():
    lines.append(f"  {job:<14} {text}")
    names = ", ".join(path.name for path in configs_of(job))
    if names:
      lines.append(f"  {'':<14} configs/{job}/: {names}")
  return "\n".join(lines)


def add_parser(subparsers) -> None:
  parser = subparsers.add_parser(
    "run",
    help="run the job a config file names: a study, or training",
    description=__doc__,
    epilog=jobs_help(),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    "config", type=options.path_text, help="Python file defining get_config(), e.g. configs/<job>/tiny.py"
  )
  parser.add_argument(
    "--workdir",
    type=options.workdir_text,
    help="output folder: new, empty or a kvjax workdir of this job (default: runs/<job>_<config stem>)",
  )
  options.add_set_option(parser)
  options.add_mesh_option(parser)
  parser.set_defaults(func=command)
