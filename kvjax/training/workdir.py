"""Workdir ownership: kvjax writes only into a directory it owns, and one process at a time.

Everything that writes a workdir (kvjax run, training, uptraining, an import, a study) first
claims it with `claim(path, kind, job)`, a context manager held for the whole run. A directory
may be claimed when it
  - does not exist yet, or is empty: the claim creates it and writes the marker
    kvjax-workdir.json first thing, recording the workdir's kind ("train", "uptrain", "import",
    "study") and its job (what identifies the run: an uptraining's source and settings, an
    import's source, a study's config class, ...);
  - holds a marker of the same kind whose job the caller accepts (`same_job`, by default: the
    same job); the marker is then rewritten with this job (a resumed run's new step count).
Every marker records the kvjax version that wrote it; a marker without one (written before
kvjax recorded versions) is refused with a message saying so. Anything else -- a Hugging Face model folder, another kind's workdir, a folder of unknown files,
a file, a directory this process may not write -- is refused with a WorkdirRefused (a ValueError)
saying why, before a byte is written into it.

One process per workdir: the claim holds an exclusive flock on kvjax-workdir.lock and writes its
pid and command there; a second process is refused with them. The kernel releases a flock when
its holder dies, so a killed run never blocks the next one. Claims nest within a process: a
claim of a path this process holds, of the same kind, joins it (`kvjax run` claims a training
workdir, then train.run claims it again). A study's workdir holds the workdirs of its training
and uptraining runs, each claimed by its own run.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import shlex
import importlib.metadata
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np


MARKER = "kvjax-workdir.json"
LOCK = "kvjax-workdir.lock"
_MARKER_TMP = f"{MARKER}.tmp"  # a marker being written; left by a kill, it does not count as content
TRAIN, UPTRAIN, IMPORT, STUDY = "train", "uptrain", "import", "study"

_held: dict[Path, str] = {}  # resolved path -> kind, for the claims this process holds


class WorkdirRefused(ValueError):
  """kvjax will not write into this directory; the message says why."""


class WorkdirInUse(WorkdirRefused):
  """Another process holds the workdir's lock; the message names it."""


def resolve(path: str | os.PathLike) -> Path:
  """The absolute path of a workdir; an empty path (which would mean the current directory) is
  refused."""
  if not os.fspath(path).strip():
    raise WorkdirRefused(
      "the workdir is an empty path, which would be the current directory; name the directory to write into"
    )
  return Path(path).expanduser().resolve()


def held(path: str | os.PathLike) -> str | None:
  """The kind of this process's claim on `path`, or None when it holds none."""
  return _held.get(resolve(path))


def check(
  path: str | os.PathLike, kind: str, job: dict | None = None, *, same_job: Callable[[dict], None] | None = None
) -> Path:
  """Reads `path` and raises WorkdirRefused unless `claim` could take it (job None: any job of
  `kind`); writes nothing. Returns the resolved path. For refusing early, before a slow step
  that the claim's job depends on."""
  path = resolve(path)
  _inspect(path, kind, job, same_job)
  return path


@contextlib.contextmanager
def claim(
  path: str | os.PathLike, kind: str, job: dict, *, same_job: Callable[[dict], None] | None = None
) -> Iterator[Path]:
  """Claims the workdir `path` for a `kind` job identified by `job` (JSON) and holds its lock until
  the block ends; yields the resolved path.

  same_job(recorded_job) raises ValueError when a marked workdir's recorded job is not this one
  (default: unless equal); it only reads.
  """
  path = resolve(path)
  if path in _held:
    if _held[path] != kind:
      raise WorkdirRefused(f"{path} is claimed by this process for another kind of job ({_held[path]}, not {kind})")
    yield path
    return
  _inspect(path, kind, job, same_job)  # before the lock file: a refused directory is not touched
  try:
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  except OSError as err:
    raise WorkdirRefused(f"cannot write into {path}: {err.strerror or err}") from None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise WorkdirInUse(
        f"{path} is in use by another kvjax process ({_holder(fd)}); wait for it to finish, or use another workdir"
      ) from None
    except OSError as err:
      raise WorkdirRefused(f"cannot lock {path / LOCK}: {err.strerror or err}") from None
    # Again under the lock: another process may have claimed the directory since.
    recorded = _inspect(path, kind, job, same_job)
    try:
      if recorded != job:
        _write_marker(path, kind, job)
      os.ftruncate(fd, 0)
      os.pwrite(fd, (json.dumps(_process()) + "\n").encode(), 0)
    except OSError as err:
      raise WorkdirRefused(f"cannot write into {path}: {err.strerror or err}") from None
    _held[path] = kind
    try:
      yield path
    finally:
      del _held[path]
      with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)  # so a holder line never names a finished process
  finally:
    os.close(fd)  # releases the flock


def study_job(config: Any) -> dict:
  """The job of a study's workdir: its config class (the GQA table and figures share a workdir,
  their stages file checks their settings)."""
  return {"study": f"{type(config).__module__}.{type(config).__qualname__}"}


def claim_study(path: str | os.PathLike, config: Any) -> contextlib.AbstractContextManager[Path]:
  """claim(path, STUDY, study_job(config))."""
  return claim(path, STUDY, study_job(config))


def fingerprint(config: dict, params) -> str:
  """sha256 over a run config (as canonical JSON) and every parameter array: its tree path, dtype,
  shape and bytes. Names a model's exact weights, wherever they are stored."""
  digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    array = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f"{jax.tree_util.keystr(key_path)} {array.dtype} {array.shape}\n".encode())
    digest.update(array.reshape(-1).view(np.uint8).data)  # the raw bytes, whatever the dtype
  return digest.hexdigest()


def _inspect(path: Path, kind: str, job: dict | None, same_job) -> dict | None:
  """Raises WorkdirRefused unless `path` may be claimed; returns the job its marker records
  (None: no marker yet). Only reads."""
  if not path.exists():
    parent = next(p for p in path.parents if p.exists())
    if not parent.is_dir():
      raise WorkdirRefused(f"cannot create {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
      raise WorkdirRefused(f"cannot create {path}: {parent} is not writable")
    return None
  if not path.is_dir():
    raise WorkdirRefused(f"{path} is a file, not a directory")
  if not os.access(path, os.W_OK | os.X_OK):
    raise WorkdirRefused(f"{path} is not writable")
  marker = path / MARKER
  if marker.exists():
    recorded = _read_marker(marker)
    if recorded["kind"] != kind:
      raise WorkdirRefused(
        f"{path} is a kvjax workdir of another kind ({recorded['kind']}, not {kind}); use another workdir"
      )
    if job is not None:
      (same_job or _equal_job(path, kind, job))(recorded["job"])
    return recorded["job"]
  try:
    entries = sorted(entry.name for entry in os.scandir(path) if entry.name not in (LOCK, _MARKER_TMP))
  except OSError as err:
    raise WorkdirRefused(f"cannot read {path}: {err.strerror or err}") from None
  if entries:
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    counted = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
    raise WorkdirRefused(
      f"{path} is not empty ({counted}: {shown}) and no {MARKER} marks it "
      f"as a kvjax workdir of this kind ({kind}): kvjax writes only into a new or empty "
      "directory or a workdir it made for this kind of job; use another workdir"
    )
  return None


def _equal_job(path: Path, kind: str, job: dict) -> Callable[[dict], None]:
  def same_job(recorded: dict) -> None:
    if recorded != job:
      raise WorkdirRefused(
        f"{path} is the workdir of another {kind} job: it records {json.dumps(recorded)}, "
        f"this one is {json.dumps(job)}; use another workdir"
      )

  return same_job


def _read_marker(marker: Path) -> dict:
  try:
    recorded = json.loads(marker.read_text())
  except (OSError, ValueError) as err:
    raise WorkdirRefused(f"cannot read the workdir marker {marker}: {err}") from None
  if not (
    isinstance(recorded, dict) and isinstance(recorded.get("kind"), str) and isinstance(recorded.get("job"), dict)
  ):
    raise WorkdirRefused(f"the workdir marker {marker} is damaged (no kind and job)")
  if not isinstance(recorded.get("kvjax_version"), str):
    raise WorkdirRefused(
      f"{marker.parent} was written by a kvjax from before workdirs recorded their version "
      f"(its {MARKER} has no kvjax_version); kvjax {version()} does not read it: use a new "
      "workdir, and import or train the model again"
    )
  return recorded


def version() -> str:
  """The installed kvjax's version, recorded in every workdir marker."""
  return importlib.metadata.version("kvjax")


def _write_marker(path: Path, kind: str, job: dict) -> None:
  """Atomically and durably: a marker is whole or absent, even after a crash."""
  now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  tmp = path / _MARKER_TMP
  with open(tmp, "w") as f:
    f.write(json.dumps({"kind": kind, "job": job, "kvjax_version": version(), "written": now}, indent=2) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path / MARKER)


def _process() -> dict:
  """Who holds a lock: what the refusal of a second process names."""
  command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "?"
  return {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "command": command,
    "since": datetime.datetime.now().isoformat(timespec="seconds"),
  }


def _holder(fd: int) -> str:
  try:
    holder = json.loads(os.pread(fd, 4096, 0).decode())
    return f"pid {holder['pid']} on {holder['host']} since {holder['since']}: {holder['command']}"
  except (OSError, ValueError, KeyError, TypeError):
    return "its pid is not recorded yet"
