"""Strict mapping of checkpoint tensors onto a model's declared weights.

Every checkpoint tensor must be consumed, every declared weight provided, every shape match;
anything else is a `CheckpointError` that names the tensor (rvLLM §5: no silent omissions)."""

from __future__ import annotations

import re
from typing import Callable, Mapping

import numpy as np
from tqdm.auto import tqdm

from rvjax.config import ModelConfig
from rvjax.errors import CheckpointError
from rvjax.models import family
from rvjax.models.params import flat_names, is_param, unflatten


def expand_names(template: Mapping[str, str], num_layers: int) -> dict[str, str]:
    """Checkpoint name -> canonical name, with `{i}` expanded for every layer."""
    out = {}
    for ckpt, canon in template.items():
        if "{i}" in ckpt:
            for i in range(num_layers):
                out[ckpt.format(i=i)] = canon.format(i=i)
        else:
            out[ckpt] = canon
    return out


def map_tensors(cfg: ModelConfig, names: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]],
                load: Callable[[str], np.ndarray], *, norm_offset: float = 0.0, desc: str = "loading"):
    """Build the weights tree for `cfg` from checkpoint tensors.

    names: checkpoint name -> canonical name; shapes: checkpoint name -> shape as stored (matrices [out, in],
    which is also how rvjax declares them);
    load(name) -> float32 array of that shape. norm_offset is added to every norm scale (HF Gemma's 1 + w)."""
    specs = family(cfg.family).specs(cfg)
    declared = flat_names(specs, is_leaf=is_param)
    unused = sorted(n for n in shapes if n not in names or names[n] not in declared)
    if unused:
        raise CheckpointError(f"checkpoint tensor {unused[0]!r} is not used by the {cfg.family} model"
                              + (f" (and {len(unused) - 1} more: {unused[1:4]}...)" if len(unused) > 1 else ""))
    provided = {names[n]: n for n in shapes}
    missing = [c for c in declared if c not in provided]
    if missing:
        want = {v: k for k, v in names.items()}
        raise CheckpointError(f"checkpoint is missing tensor {want.get(missing[0], missing[0])!r} "
                              f"(weight {missing[0]}; {len(missing)} missing in all)")
    for canon, ckpt in provided.items():
        expect = declared[canon].shape
        stored = tuple(shapes[ckpt])
        if stored != expect:
            raise CheckpointError(f"checkpoint tensor {ckpt!r} has shape {stored}, expected {expect} "
                                  f"for {cfg.family} weight {canon}")
    arrays = {}
    for canon, ckpt in tqdm(provided.items(), desc=desc, unit="tensor", leave=False):
        a = np.asarray(load(ckpt), dtype=np.float32)
        if norm_offset and re.search(r"norm$", canon):
            a = a + np.float32(norm_offset)
        arrays[canon] = a
    return unflatten(specs, arrays)
