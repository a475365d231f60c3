"""Per-chip memory of a model: weights, sliding-layer KV and global-layer KV, from the declarations alone.

Tensor parallelism over TP chips splits vocab, query heads, FFN and KV heads; a layer whose KV heads do not
divide by TP keeps them replicated (the rule rvjax/sharding applies). Nothing is allocated."""

from __future__ import annotations

import jax.numpy as jnp

from rvjax.cache import kv as kvcache
from rvjax.config import ModelConfig
from rvjax.models import family
from rvjax.models.params import flat_names, is_param

TP_AXES = ("vocab", "q_heads", "ffn", "kv_heads")


def _layer_of(name: str) -> int | None:
    """Layer index of a canonical weight name ("layers.3.k", "blocks.0.3.k"), None for model-level ones."""
    parts = name.split(".")
    nums = [int(p) for p in parts if p.isdigit()]
    return nums[-1] if nums else None


def _weight_split(cfg: ModelConfig, name: str, axes, tp: int) -> int:
    """How many ways TP splits one weight: tp when it has a TP axis that divides, else 1 (replicated)."""
    for axis in axes:
        if axis not in TP_AXES:
            continue
        if axis == "kv_heads" and cfg.layer_kv_heads(_layer_of(name)) % tp:
            return 1
        return tp
    return 1


def memory_budget(cfg: ModelConfig, max_model_len: int, batch: int = 1, tp: int = 1, kv_dtype: str = "int8",
                  weight_dtype: str = "bfloat16", *, split: bool | None = None,
                  block_k: int = kvcache.DEFAULT_BLOCK_K) -> dict[str, float]:
    """Bytes per chip: {"weights", "sliding_kv", "global_kv", "total"}. `split` defaults to the engine's
    rule (split-cache above 32K context)."""
    if split is None:
        split = max_model_len > 32 * 1024 and any(cfg.is_sliding(i) for i in range(cfg.num_layers))
    itemsize = jnp.dtype(weight_dtype).itemsize
    weights = 0.0
    for name, p in flat_names(family(cfg.family).specs(cfg), is_leaf=is_param).items():
        n = 1
        for s in p.shape:
            n *= s
        weights += n * itemsize / _weight_split(cfg, name, p.axes, tp)
    kv = kvcache.cache_bytes(cfg, batch, max_model_len, kv_dtype, split=split, block_k=block_k, tp=tp)
    return {"weights": weights, "sliding_kv": kv["sliding"], "global_kv": kv["global"],
            "total": weights + kv["sliding"] + kv["global"]}
