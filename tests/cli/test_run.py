"""`kvjax run`: a config's job found as a study module of kvjax/studies (or the library job train),
the study's table alone on stdout and its progress on stderr, the configs of every study, and the
errors of a config that names no job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import kvjax.studies
from kvjax.cli import main as cli
from kvjax.cli import run

ROOT = Path(__file__).resolve().parents[2]

# A study module as kvjax/studies holds them: its config dataclass, run(), its report through
# kvjax.studies.base.report; it prints a line of its own, which must not reach stdout.
HELLO_STUDY = '''"""Greets the world: the study of the tests of `kvjax run`.

Its rows hold the greeting and the kv heads of its model.
"""

import dataclasses

from kvjax.config import ModelConfig
from kvjax.studies.base import report


@dataclasses.dataclass(frozen=True)
class HelloStudy:
  job: str = "hello_study"
  greeting: str = "hello"
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)


def run(study, workdir, progress):
  progress("stage greet: running")
  print("a line the study prints")
  rows = [{"greeting": study.greeting, "kv_heads": study.model.num_kv_heads}]
  table = report.write_table(rows, workdir / "hello_study", report.columns_of(rows[0]))
  (workdir / "hello_study.md").write_text(f"# Hello\\n\\n{table}\\n")
  return rows
'''

HELPER = '''"""A helper of the studies: not a job (kvjax.studies.JOBS), so not a study."""


def greet():
  return "hi"
'''

CONFIG = """
from kvjax.studies.hello_study import HelloStudy


def get_config():
  return HelloStudy(job={job!r})
"""


@pytest.fixture
def studies(tmp_path, monkeypatch):
  """kvjax/studies holding only the study hello_study (the one job of kvjax.studies.JOBS) and a
  helper module; its configs folder holds configs/hello_study/greet.py. Returns that config file."""
  folder = tmp_path / "kvjax_studies"
  folder.mkdir()
  (folder / "hello_study.py").write_text(HELLO_STUDY)
  (folder / "greetings.py").write_text(HELPER)
  configs = tmp_path / "configs"
  (configs / "hello_study").mkdir(parents=True)
  config = configs / "hello_study" / "greet.py"
  config.write_text(CONFIG.format(job="hello_study"))
  monkeypatch.setattr(run, "STUDIES", folder)
  monkeypatch.setattr(run, "JOBS", ("hello_study",))
  monkeypatch.setattr(run, "CONFIGS", configs)
  monkeypatch.setattr(kvjax.studies, "__path__", [*kvjax.studies.__path__, str(folder)])
  yield config
  for name in ("kvjax.studies.hello_study", "kvjax.studies.greetings"):
    sys.modules.pop(name, None)


def test_a_study_prints_its_table_alone_and_its_progress_on_stderr(studies, tmp_path, capsys):
  workdir = tmp_path / "runs" / "hello"
  argv = ["run", str(studies), "--workdir", str(workdir), "--set", "greeting='hi'", "model.num_kv_heads=2"]
  assert cli.main(argv) == 0
  out, err = capsys.readouterr()
  assert out == "# Hello\n\n| greeting | kv_heads |\n|---|---|\n| hi | 2 |\n"
  assert err.splitlines() == ["stage greet: running", "a line the study prints"]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["greeting"] == "hi" and saved["model"]["num_kv_heads"] == 2 and saved["job"] == "hello_study"
  assert json.loads((workdir / "hello_study.json").read_text()) == [{"greeting": "hi", "kv_heads": 2}]


def test_the_default_workdir_is_named_by_job_and_config(studies, tmp_path, monkeypatch, capsys):
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  assert cli.main(["run", str(studies)]) == 0
  assert (elsewhere / "runs" / "hello_study_greet" / "hello_study.md").is_file()


def test_help_lists_each_study_once_with_its_configs(studies, capsys):
  with pytest.raises(SystemExit):
    cli.main(["run", "--help"])
  out = capsys.readouterr().out
  assert "  hello_study    Greets the world: the study of the tests of `kvjax run`.\n" in out
  assert "                 configs/hello_study/: greet.py\n" in out
  assert "  train          train a model from scratch" in out
  assert "greetings" not in out and "Its rows hold" not in out


@pytest.mark.parametrize(
  "content, message",
  [
    (
      CONFIG.format(job="greetings"),
      "unknown job 'greetings' in config file {config}: not a study (hello_study) nor a library job (train)",
    ),
    ("x = 1\n", "does not define get_config()"),
    ("def get_config():\n  return {'job': 'train'}\n", "must return a config dataclass with a `job` field"),
    (CONFIG.format(job="hello_study"), "unknown config key 'greting'"),
  ],
)
def test_errors_name_the_config_and_write_nothing(studies, tmp_path, capsys, content, message):
  config = tmp_path / "bad.py"
  config.write_text(content)
  argv = ["run", str(config), "--workdir", str(tmp_path / "w")]
  if "greting" in message:
    argv += ["--set", "greting='hi'"]
  assert cli.main(argv) == 2
  assert message.format(config=config) in capsys.readouterr().err
  assert not (tmp_path / "w").exists()  # nothing written before the job resolves


def test_missing_config_file(tmp_path, capsys):
  assert cli.main(["run", str(tmp_path / "absent.py")]) == 2
  assert "config file not found" in capsys.readouterr().err


def test_every_config_lives_in_its_jobs_folder_and_resolves():
  """configs/<job>/<name>.py: the folder names the job, so no two configs share a default workdir."""
  paths = sorted((ROOT / "configs").glob("*/*.py"))
  assert len(paths) > 10
  workdirs = set()
  for path in paths:
    config = run.load_config(path)
    assert callable(run.resolve_job(config.job, path)), path
    assert path.parent.name == config.job, path
    workdirs.add(run.default_workdir(config, path))
  assert len(workdirs) == len(paths)


def test_every_study_module_has_configs_of_its_job():
  for job in run.study_modules():
    configs = run.configs_of(job)
    assert configs, job
    jobs = {run.load_config(path).job for path in configs}
    assert jobs == {job}, job


@pytest.mark.parametrize(
  "config, job, message",
  [
    ("train/tiny.py", "gqa_table", "the TrainRun of config file {config} runs as job 'train', got job='gqa_table'"),
    ("gqa_table/tiny.py", "kv_memory", "GqaStudy.job must be one of ('gqa_table', 'gqa_figure4', 'gqa_figure5', "),
    ("kv_memory/tiny.py", "gqa_table", "KVMemoryStudy.job must be 'kv_memory', got 'gqa_table'"),
  ],
)
def test_a_config_runs_only_as_a_job_of_its_kind(tmp_path, capsys, config, job, message):
  path = ROOT / "configs" / config
  assert cli.main(["run", str(path), "--workdir", str(tmp_path / "w"), "--set", f"job={job!r}"]) == 2
  assert message.format(config=path) in capsys.readouterr().err
  assert not (tmp_path / "w").exists()


def test_the_jobs_are_declared_once_and_no_job_imports_another():
  """kvjax.studies.JOBS names exactly the study modules with a `run`, and pyproject.toml's
  independence contract (checked by lint-imports in .ci/run) lists the same modules."""
  import ast
  import tomllib

  from kvjax.studies import JOBS

  defines_run = {
    path.stem
    for path in run.STUDIES.glob("*.py")
    if any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in ast.parse(path.read_text()).body)
  }
  assert set(JOBS) == defines_run
  contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
  independent = [c["modules"] for c in contracts if c["type"] == "independence"]
  assert independent == [[f"kvjax.studies.{job}" for job in JOBS]]
  # The studies' layers contract puts the jobs, and only them, on top.
  (layers,) = [c["layers"] for c in contracts if c.get("containers") == ["kvjax.studies"]]
  assert sorted(layers[0].split(" | ")) == sorted(JOBS)
