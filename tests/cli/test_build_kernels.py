"""`kvjax build-kernels`: prints what kvjax.kernels.build.build() built as JSON; a failed build
prints the compiler's message and exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvjax.cli import main as cli


def test_prints_the_build_as_json(monkeypatch, capsys):
  monkeypatch.setenv("KVJAX_CPU_KERNELS", "none")  # nothing selected: nothing to compile
  assert cli.main(["build-kernels"]) == 0
  assert json.loads(capsys.readouterr().out) == {"kernels": [], "library": None}


def test_a_failed_build_exits_1_with_the_compiler_message(tmp_path):
  # A fresh process: a build is done once per process, and this one must not find it done.
  env = dict(
    os.environ,
    CXX=str(tmp_path / "no-such-c++"),
    KVJAX_CACHE=str(tmp_path / "cache"),
    KVJAX_CPU_KERNELS="matmul",
    JAX_PLATFORMS="cpu",
  )
  proc = subprocess.run(
    [sys.executable, "-m", "kvjax.cli.main", "build-kernels"], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 1, proc.stderr
  assert proc.stdout == ""
  assert proc.stderr.startswith("kvjax build-kernels: error: ")
  assert "no-such-c++" in proc.stderr
