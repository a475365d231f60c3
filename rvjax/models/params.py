"""Each weight is declared once (shape, logical axes, init); abstract shapes, initialisation,
checkpoint names and (later) shardings all derive from that one declaration."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Param:
    """A weight's declaration. Not a pytree node: trees of `Param` are trees of declarations."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, mapped to mesh axes only in rvjax/sharding
    init: str = "normal"  # "normal" | "ones" | "zeros"

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


def is_param(x: Any) -> bool:
    return isinstance(x, Param)


def abstract(specs, dtype=jnp.float32):
    """ShapeDtypeStructs for a tree of declarations (for `jax.eval_shape` and restore targets)."""
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), specs, is_leaf=is_param)


def init(specs, key: jax.Array, dtype=jnp.float32, scale: float = 0.02):
    """Random weights for tests: normal(0, scale) matrices, ones/zeros where declared."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_param)
    keys = jax.random.split(key, len(leaves))

    def one(p: Param, k):
        if p.init == "ones":
            return jnp.ones(p.shape, dtype)
        if p.init == "zeros":
            return jnp.zeros(p.shape, dtype)
        return (scale * jax.random.normal(k, p.shape)).astype(dtype)

    return jax.tree.unflatten(treedef, [one(p, k) for p, k in zip(leaves, keys)])


def flat_names(tree, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{"layers[3].attn.q": leaf, ...}: the canonical names the loaders map checkpoint tensors to."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        out[jax.tree_util.keystr(path, simple=True, separator=".")] = leaf
    return out


def unflatten(specs, named: dict[str, np.ndarray]):
    """The weights tree shaped like `specs`, with leaves taken from `named` by canonical name."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_param)
    return jax.tree.unflatten(treedef, [named[jax.tree_util.keystr(p, simple=True, separator=".")] for p, _ in paths])
