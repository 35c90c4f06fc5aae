"""kvjax's CPU kernels (csrc/*.cc): built on first use, registered with XLA as FFI targets.

The sources are compiled together into one shared library with the system's C++ compiler,
cached in $KVJAX_CACHE (default ~/.cache/kvjax) under a key of the sources, the
flags, the compiler, jaxlib and the CPU's features. Without a compiler, or on any build or
load failure, kvjax warns once and every product and attention runs in XLA.

KVJAX_CPU_KERNELS selects the kernels, read once per process: unset for all, "none" (or "0",
or empty) for none, or a comma list of names ("matmul", "attention"), e.g. to compare one
against XLA.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jaxlib

CSRC = pathlib.Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cc"))
COMPILE_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC"]
# name -> {XLA target: exported handler symbol}
KERNELS = {
  "matmul": {"kvjax_small_matmul": "KvjaxSmallMatmul"},
  "attention": {
    f"kvjax_{layout.lower()}_attention{suffix}": f"Kvjax{layout}Attention{symbol}"
    for layout in ("Decode", "Paged")
    for suffix, symbol in (
      ("", ""),
      ("_bf16", "Bf16"),
      ("_f16", "F16"),
      ("_int8", "Int8"),
      ("_fp8", "Fp8"),
      ("_int4", "Int4"),
    )
  }
  | {"kvjax_prompt_attention": "KvjaxPromptAttention", "kvjax_kivi_attention": "KvjaxKiviAttention"},
}


def _cpu_features() -> str:
  """The CPU's instruction-set line (x86 "flags", Arm "Features"): -march=native depends on it."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.processor()


def _compiler() -> str:
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise RuntimeError("no C++ compiler found (set CXX)")
  return compiler


COMPILE_TIMEOUT_S = 600  # a compiler that hangs must not hang kvjax


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    raise RuntimeError(f"{' '.join(cmd[:1])} did not finish within {timeout:.0f} s") from None
  except OSError as err:
    raise RuntimeError(f"cannot run the C++ compiler {cmd[0]!r} ({err.strerror}); set CXX") from None


def _library_path(compiler: str) -> pathlib.Path:
  """Where the library built from these sources, by this compiler, for this jaxlib and CPU is cached."""
  version = _run([compiler, "--version"], 60).stdout
  files = [f.read_text() for f in sorted(CSRC.glob("*.[ch]*"))]  # sources and headers
  key = hashlib.sha256(
    "\n".join(
      [*files, " ".join(COMPILE_FLAGS), compiler, version, jaxlib.__version__, platform.machine(), _cpu_features()]
    ).encode()
  )
  cache = pathlib.Path(os.environ.get("KVJAX_CACHE", pathlib.Path.home() / ".cache" / "kvjax"))
  return cache / f"kvjax_cpu-{key.hexdigest()[:16]}.so"


def _compile(compiler: str, path: pathlib.Path) -> None:
  with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
    out = pathlib.Path(tmp) / path.name
    cmd = [compiler, *COMPILE_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(out)]
    done = _run(cmd, COMPILE_TIMEOUT_S)
    if done.returncode != 0:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(out, path)  # atomic: a reader never loads a half-written library


def _load(compiler: str) -> tuple[ctypes.CDLL, pathlib.Path]:
  """The library, built first unless cached. An exclusive lock on a file beside it makes a second
  process wait for the first one's build rather than compile the same sources again; the kernel
  releases the lock if its holder dies."""
  path = _library_path(compiler)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if path.exists():
      try:
        return ctypes.cdll.LoadLibrary(str(path)), path
      except OSError:
        pass  # a damaged or foreign build: rebuild it
    _compile(compiler, path)
    return ctypes.cdll.LoadLibrary(str(path)), path


@functools.cache
def _library(selected: frozenset[str]) -> pathlib.Path:
  """Builds (or loads) the library and registers the selected kernels with XLA, once per process."""
  library, path = _load(_compiler())
  for name in selected:
    for target, symbol in KERNELS[name].items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
  return path


def _selected() -> set[str]:
  value = os.environ.get("KVJAX_CPU_KERNELS")
  if value is None:
    return set(KERNELS)
  names = {n.strip() for n in value.split(",") if n.strip()} - {"none", "0"}
  if unknown := names - set(KERNELS):
    raise ValueError(
      f"KVJAX_CPU_KERNELS={value!r}: unknown kernels {sorted(unknown)}; choose from {sorted(KERNELS)}, or 'none'"
    )
  return names


def build() -> dict:
  """Builds and registers the kernels KVJAX_CPU_KERNELS selects, now (`kvjax build-kernels`).
  Returns {"kernels": [...], "library": path}; raises RuntimeError with the compiler's message."""
  selected = frozenset(_selected())
  if not selected:
    return {"kernels": [], "library": None}
  return {"kernels": sorted(selected), "library": str(_library(selected))}


@functools.cache
def _registered() -> frozenset[str]:
  selected = frozenset(_selected())
  if not selected:
    return frozenset()
  try:
    _library(selected)
  except Exception as e:  # noqa: BLE001 - any failure to build or load means XLA, said once
    warnings.warn(f"kvjax: the CPU kernels are unavailable, using XLA ({e})")
    return frozenset()
  return selected


def available(name: str) -> bool:
  """Whether kernel `name` ("matmul" or "attention") is built and registered (building on first call)."""
  return name in _registered()


@functools.cache
def bfloat16_arithmetic() -> bool:
  """Whether this CPU multiplies bfloat16 natively (x86 AVX512_BF16 or AMX-BF16, Arm BF16). Where
  it does not, XLA's bfloat16 products run slower than its float32 ones (Zen 3 cores, 1,024 x 576
  by 576 x 1,536: 93-104 GFLOP/s against 149-167)."""
  flags = _cpu_features().split()
  return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "bf16"))


def single_cpu() -> bool:
  """Whether jax runs on one CPU device: the kernels' domain (a mesh or an accelerator uses XLA)."""
  return jax.default_backend() == "cpu" and jax.device_count() == 1
