"""SPMD sharding over a ('data', 'model') device mesh, Megatron style, with JAX's own partitioner.

Batch rows are split over `data`. Over `model`:
  q kernel [D, N, H], bias [N, H]        column-parallel on N (query heads)
  k, v kernels [D, K, H], biases [K, H]  column-parallel on K (kv heads)
  out kernel [N, H, D]                   row-parallel on N: the one reduction of attention
  mlp gate, up [D, F]; down [F, D]       column- then row-parallel on F
  embed [V, D], lm_head [D, V]           on V (vocabulary)
  KV cache                               as its kind says (KVCache.partition_rule): a contiguous
                                         cache's [B, heads, ...] arrays rows on `data`, heads on
                                         `model`; a paged cache's pools [heads, P, Z, ...] heads on
                                         `model`; lengths and page table on `data`. An MLA cache's
                                         one latent "head" does not split: it is replicated over
                                         `model`, and its sequence is never split
Norms, position embeddings and output biases are replicated. Optimizer moments follow their
parameters. Query head n reads kv head n // G (`kv_head_of`), so when K is a multiple of the
model axis each device holds whole kv groups, the queries that read them and their cache:
attention needs no communication until the output projection.

An axis that does not divide by its mesh axis is replicated instead: with fewer kv heads than
model devices the k/v weights and the cache are kept whole on every device (vLLM's rule).

Multi-host: `initialize_distributed` calls jax.distributed.initialize() when a coordinator is
configured (JAX_COORDINATOR_ADDRESS with JAX_NUM_PROCESSES and JAX_PROCESS_ID), or under a
multi-task SLURM or Open MPI launch, which JAX detects by itself.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "model")

# (module, parameter) -> which axes split over `model`; the last two names of a leaf's path.
MODEL_AXIS_RULES = {
  ("q", "kernel"): (None, "model", None),
  ("q", "bias"): ("model", None),
  ("k", "kernel"): (None, "model", None),
  ("k", "bias"): ("model", None),
  ("v", "kernel"): (None, "model", None),
  ("v", "bias"): ("model", None),
  ("out", "kernel"): ("model", None, None),
  ("gate", "kernel"): (None, "model"),
  ("gate", "bias"): ("model",),
  ("up", "kernel"): (None, "model"),
  ("up", "bias"): ("model",),
  ("down", "kernel"): ("model", None),
  ("embed", "embedding"): ("model", None),
  ("lm_head", "kernel"): (None, "model"),
}


def parse_mesh(text: str) -> dict[str, int]:
  """'data=2,model=4' -> {'data': 2, 'model': 4}; an axis left out has size 1."""
  sizes = dict.fromkeys(MESH_AXES, 1)
  for item in filter(None, (part.strip() for part in text.split(","))):
    name, sep, value = item.partition("=")
    name = name.strip()
    if not sep or name not in MESH_AXES:
      raise ValueError(f"mesh item {item!r} must be AXIS=SIZE with AXIS one of {MESH_AXES}")
    if not value.strip().isdigit() or int(value) < 1:
      raise ValueError(f"mesh axis {name} needs a positive integer size, got {value.strip()!r}")
    sizes[name] = int(value)
  return sizes


def make_mesh(data: int = 1, model: int = 1) -> Mesh:
  """A (data, model) mesh over the first data * model devices, model-axis neighbours adjacent."""
  devices = jax.devices()
  if data * model > len(devices):
    raise ValueError(
      f"mesh data={data} x model={model} needs {data * model} devices, but "
      f"{len(devices)} are visible ({devices[0].platform})"
    )
  # Auto axes: XLA's partitioner propagates the shardings of inputs and parameters through the
  # unannotated model code (Explicit axes would need a sharding on every gather and einsum).
  return jax.make_mesh((data, model), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[: data * model])


def mesh_from_spec(spec: str | None) -> Mesh | None:
  """A 'data=D,model=M' spec (a run's train.mesh, or a command's --mesh) as a Mesh; None (no
  sharding) when there is none."""
  return None if spec is None else make_mesh(**parse_mesh(spec))


def _names(path) -> tuple[str, ...]:
  out = []
  for key in path:
    out.append(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))))
  return tuple(out)


def _fit(rule: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
  """rule with every axis that does not divide by its mesh axis replaced by None (replicated)."""
  axes = [axis if axis is not None and dim % mesh.shape[axis] == 0 else None for axis, dim in zip(rule, shape)]
  return P(*axes)


def param_sharding(tree: Any, mesh: Mesh) -> Any:
  """NamedShardings for params, or any tree holding params (a train state, optimizer moments)."""

  def one(path, leaf):
    rule = MODEL_AXIS_RULES.get(_names(path)[-2:])
    shape = np.shape(leaf)
    if rule is None or len(rule) != len(shape):
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, _fit(rule, shape, mesh))

  return jax.tree_util.tree_map_with_path(one, tree)


def shard_params(tree: Any, mesh: Mesh) -> Any:
  """Places params (or a train state) on the mesh; a no-op for leaves already placed so."""
  return jax.device_put(tree, param_sharding(tree, mesh))


def _check_batch(batch: int, mesh: Mesh) -> None:
  if batch % mesh.shape["data"]:
    raise ValueError(
      f"batch of {batch} rows does not split over the mesh's data axis of "
      f"size {mesh.shape['data']}; use a multiple of it"
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis on `data`, the rest replicated; fits arrays of any rank."""
  return NamedSharding(mesh, P("data"))


def shard_batch(mesh: Mesh, *arrays) -> tuple:
  """Places batch-major arrays (tokens [B, T], lengths [B], ...) with rows split over `data`."""
  for x in arrays:
    _check_batch(np.shape(x)[0], mesh)
  return tuple(jax.device_put(arrays, batch_sharding(mesh)))


def cache_sharding(cache: Any, mesh: Mesh) -> Any:
  """NamedShardings for a decode cache, by the rules its kind gives (KVCache.partition_rule) for
  its layers' arrays and its bookkeeping; an axis that does not divide is replicated."""

  def one(path, leaf):
    shape = np.shape(leaf)
    rule = cache.partition_rule(_names(path)[0])
    return NamedSharding(mesh, _fit(rule + (None,) * (len(shape) - len(rule)), shape, mesh))

  return jax.tree_util.tree_map_with_path(one, cache)


def initialize_distributed() -> bool:
  """Starts multi-host JAX when the environment describes a multi-process job; True if it did."""
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS"):
    count, index = env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID")
    jax.distributed.initialize(
      env["JAX_COORDINATOR_ADDRESS"],
      num_processes=int(count) if count else None,
      process_id=int(index) if index else None,
    )
    return True
  if int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    jax.distributed.initialize()  # JAX reads the SLURM / Open MPI variables itself
    return True
  return False


def place(mesh: Mesh | None, params: Any, *batch) -> tuple[Any, tuple]:
  """(params, batch arrays) placed on the mesh by these rules. Without one they are returned as
  they are, but for host (numpy) params, placed on the default device: a jitted call would copy
  host weights in again at every call."""
  if mesh is None:
    if any(isinstance(x, np.ndarray) for x in jax.tree.leaves(params)):
      params = jax.device_put(params)
    return params, batch
  return shard_params(params, mesh), shard_batch(mesh, *batch)
