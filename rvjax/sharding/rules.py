"""Logical axes (the names in rvjax/models/params.py declarations) -> mesh axes, for tensor parallelism.

The mesh is ("data", "model"). "model" is the tensor-parallel (TP) axis: q/k/v/gate/up are split by output
rows, o/down by input columns (Megatron-style: one all-reduce after attention and one after the MLP), and
the vocab axis of the embedding, which is also the tied output head. "data" carries the batch of the KV
cache and activations. Every logical axis missing from `LOGICAL_TO_MESH` is replicated ("embed",
"head_dim", "layers" (a scanned stack), None).

Head axes ([heads * head_dim] rows) are split only at whole heads. A KV-head axis whose layer's KV heads
do not divide by the TP degree is replicated (Qwen2.5-0.5B: 2 KV heads at tp=4; every chip then holds the
K/V its q heads read). Any other axis that does not divide, or two axes of one array on the same mesh axis,
is a ValueError naming the axis."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rvjax.config import ModelConfig
from rvjax.models.params import Param, is_param

DATA, MODEL = "data", "model"

LOGICAL_TO_MESH: dict[str, str] = {
    "vocab": MODEL,
    "q_heads": MODEL,
    "kv_heads": MODEL,
    "ffn": MODEL,
    "batch": DATA,  # caches and activations
}
REPLICATE_IF_INDIVISIBLE = {"kv_heads"}


def stack(*params: Param) -> Param:
    """The declaration of layers stacked for a scanned loop: a leading "layers" axis (replicated)."""
    first = params[0]
    assert all(p == first for p in params), "only identical declarations stack"
    return dataclasses.replace(first, shape=(len(params),) + first.shape, axes=("layers",) + first.axes)


def laid_out(specs, to_layout) -> Any:
    """The declarations in a model's layer layout: `to_layout` (e.g. `lambda w: gemma4.to_layout(w, cfg,
    scan=True)`, which may only regroup and stack leaves) run on leaf ids, scanned stacks declared by `stack`."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_param)
    ids = to_layout(jax.tree.unflatten(treedef, [np.array([i]) for i in range(len(leaves))]))
    return jax.tree.map(lambda a: leaves[int(a[0])] if a.ndim == 1 else stack(*(leaves[int(i)] for i in a[:, 0])),
                        ids)


def _heads(cfg: ModelConfig | None, axis: str, size: int, tp: int) -> bool:
    """Whether a [heads * head_dim] axis of `size` splits over tp chips at whole heads. The layer is told
    apart by size alone: candidates are the (heads, head_dim) pairs of cfg's layers."""
    if cfg is None:
        return size % tp == 0
    kinds = {(cfg.num_heads if axis == "q_heads" else cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
             for i in range(cfg.num_layers)}
    fits = {heads % tp == 0 for heads, h in kinds if heads * h == size}
    if len(fits) != 1:
        reason = "matches no layer's" if not fits else "is ambiguous between layers'"
        raise ValueError(f"axis {axis!r} of size {size} {reason} heads * head_dim {sorted(kinds)}")
    return fits.pop()


def partition_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape: dict[str, int],
                   cfg: ModelConfig | None = None) -> P:
    """The PartitionSpec of one array with these logical axes and shape (cfg: to split head axes at
    whole heads; without it a head axis is checked for divisibility only)."""
    out, used = [], {}
    for axis, size in zip(axes, shape):
        mesh_axis = LOGICAL_TO_MESH.get(axis) if axis is not None else None
        n = mesh_shape.get(mesh_axis, 1) if mesh_axis else 1
        if mesh_axis is None or n == 1:
            out.append(None)  # a size-1 mesh axis is not worth naming (and never collides)
            continue
        ok = _heads(cfg, axis, size, n) if axis in ("q_heads", "kv_heads") else size % n == 0
        if not ok:
            if axis in REPLICATE_IF_INDIVISIBLE:
                out.append(None)
                continue
            raise ValueError(f"axis {axis!r} of size {size} does not split over mesh axis {mesh_axis!r} "
                             f"of size {n}")
        if mesh_axis in used:
            raise ValueError(f"axes {used[mesh_axis]!r} and {axis!r} of one array both map to mesh axis "
                             f"{mesh_axis!r}")
        used[mesh_axis] = axis
        out.append(mesh_axis)
    return P(*out)


def param_shardings(cfg: ModelConfig, specs_tree, mesh) -> Any:
    """NamedShardings shaped like a tree of `Param` declarations (a model's `specs(cfg)`, or the same
    restacked with `stack` for a scanned layout). `mesh`: a Mesh or AbstractMesh over ("data", "model")."""
    shape = dict(mesh.shape)
    return jax.tree.map(lambda p: NamedSharding(mesh, partition_spec(p.axes, p.shape, shape, cfg)), specs_tree,
                        is_leaf=is_param)


# Logical axes of the cache arrays of rvjax/cache/kv.py, counted from the end (a scanned stack adds a
# leading groups axis): k, v [B, S, K, H]; k_scale, v_scale [B, S, K].
_CACHE_AXES = {"k": ("batch", None, "kv_heads", None), "v": ("batch", None, "kv_heads", None),
               "k_scale": ("batch", None, "kv_heads"), "v_scale": ("batch", None, "kv_heads")}


def cache_shardings(cache_abstract, mesh) -> Any:
    """NamedShardings for a KV cache tree (e.g. `jax.eval_shape` of a model's `new_cache`): KV heads over
    "model" when they divide (else replicated), batch over "data"."""
    shape = dict(mesh.shape)

    def one(path, x):
        name = path[-1].name if isinstance(path[-1], jax.tree_util.GetAttrKey) else None
        if name not in _CACHE_AXES:
            raise ValueError(f"unknown cache array {jax.tree_util.keystr(path)}")
        tail = _CACHE_AXES[name]
        axes = (None,) * (len(x.shape) - len(tail)) + tail
        return NamedSharding(mesh, partition_spec(axes, x.shape, shape))

    return jax.tree_util.tree_map_with_path(one, cache_abstract)
