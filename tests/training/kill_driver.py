"""Runs one `kvjax` command in this process and SIGKILLs it at a chosen point (tests/training/test_faults.py).

  python kill_driver.py PLAN.json ARGS...   # as `kvjax ARGS...`

PLAN is a JSON object:
  workdir     the folder whose writes are counted
  kill_at     [position, n] or null. position is the training step reached (batches drawn; 0
              before the first, and before the sampler of a resumed run is restored); n is the
              n-th write into the workdir at that position, or null for the moment before the
              next batch is drawn. When the n-th write never comes (position moves on first),
              the kill comes at the next write or batch instead.
  record      a path: at exit, the list of [position, n, kind, path] of every write (no kill)
  last_words  a path: just before the kill, {"position", "n", "kind", "path"} of the point

A write is a mkdir, rename or replace, unlink or remove, rmdir (killed before it happens), or an
open for writing (killed right after it returns: the file created or emptied, nothing written
yet), at a path inside the workdir: kvjax's own files and orbax's checkpoint files, its
temporary folders, renames and the rotation's deletions alike. Array data that tensorstore
writes from C++ falls between these points.
"""

from __future__ import annotations

import atexit
import builtins
import io
import json
import os
import signal
import sys
import threading

plan = json.loads(open(sys.argv[1]).read())
workdir = os.path.realpath(plan["workdir"])
kill_at = plan.get("kill_at")
writes: list = []
counts: dict[int, int] = {}
samplers: list = []
lock = threading.RLock()
real = {name: getattr(os, name) for name in ("mkdir", "rename", "replace", "remove", "unlink", "rmdir", "open")}
real_open = io.open


def position() -> int:
  return samplers[-1].position if samplers else 0


KILLING = threading.Lock()  # the first thread to reach a kill point writes the last words; others wait


def kill(point: dict) -> None:
  KILLING.acquire()  # never released: the process dies holding it
  with real_open(plan["last_words"], "w") as f:
    f.write(json.dumps(point))
  os.kill(os.getpid(), signal.SIGKILL)


def inside(path, dir_fd=None) -> str | None:
  """The path relative to the workdir, or None outside it."""
  if isinstance(path, int):
    return None
  path = os.fsdecode(path)
  if dir_fd is not None:
    path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
  path = os.path.abspath(path)
  return os.path.relpath(path, workdir) if path == workdir or path.startswith(workdir + os.sep) else None


def write(kind: str, path, dir_fd=None, after=None):
  """Counts a write; kills before it (or, for an open, after `after()` performed it) when due."""
  relative = inside(path, dir_fd)
  if relative is None:
    return after() if after else None
  with lock:
    here = position()
    counts[here] = counts.get(here, 0) + 1
    n = counts[here]
    writes.append([here, n, kind, relative])
    point = {"position": here, "n": n, "kind": kind, "path": relative}
    due = kill_at is not None and (
      here > kill_at[0] or (here == kill_at[0] and kill_at[1] is not None and n >= kill_at[1])
    )
    if due and after is None:
      kill(point)
  result = after() if after else None
  if due:
    kill(point)
  return result


def wrap(name: str, kind: str):
  def wrapper(path, *args, dir_fd=None, **kwargs):
    write(kind, path, dir_fd)
    return real[name](path, *args, dir_fd=dir_fd, **kwargs) if dir_fd is not None else real[name](path, *args, **kwargs)

  setattr(os, name, wrapper)


for name, kind in (("mkdir", "mkdir"), ("remove", "delete"), ("unlink", "delete"), ("rmdir", "rmdir")):
  wrap(name, kind)


def rename(src, dst, *args, **kwargs):
  write("rename", src)
  return real["rename"](src, dst, *args, **kwargs)


def replace(src, dst, *args, **kwargs):
  write("rename", src)
  return real["replace"](src, dst, *args, **kwargs)


def opener(file, mode="r", *args, **kwargs):
  if isinstance(file, int) or not any(c in mode for c in "wax+"):
    return real_open(file, mode, *args, **kwargs)
  return write("open", file, after=lambda: real_open(file, mode, *args, **kwargs))


def os_open(path, flags, *args, dir_fd=None, **kwargs):
  call = lambda: real["open"](path, flags, *args, dir_fd=dir_fd, **kwargs)
  if not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
    return call()
  return write("open", path, dir_fd, after=call)


os.rename, os.replace, os.open = rename, replace, os_open
io.open = builtins.open = opener

from kvjax.training import data  # noqa: E402  (after the hooks: kvjax binds nothing of os at import)

real_init, real_next = data.WindowSampler.__init__, data.WindowSampler.next


def sampler_init(self, *args, **kwargs):
  real_init(self, *args, **kwargs)
  samplers.append(self)


def sampler_next(self):
  if kill_at is not None and kill_at[0] <= self.position:
    kill({"position": self.position, "n": None, "kind": "step", "path": None})
  return real_next(self)


data.WindowSampler.__init__, data.WindowSampler.next = sampler_init, sampler_next

if plan.get("record"):
  atexit.register(lambda: real_open(plan["record"], "w").write(json.dumps(writes)))

from kvjax.cli import main  # noqa: E402

sys.exit(main.main(sys.argv[2:]))
