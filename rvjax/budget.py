"""Per-chip memory of a model: weights, sliding-layer KV and global-layer KV, from the declarations alone.

Tensor parallelism over TP chips splits what rvjax/sharding/rules.py splits: vocab, query heads, FFN and KV
heads, a layer's KV heads replicated when they do not divide by TP. Nothing is allocated."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rvjax.cache import kv as kvcache
from rvjax.config import ModelConfig
from rvjax.models import family
from rvjax.models.params import is_param
from rvjax.sharding.rules import MODEL, partition_spec


def memory_budget(cfg: ModelConfig, max_model_len: int, batch: int = 1, tp: int = 1, kv_dtype: str = "int8",
                  weight_dtype: str = "bfloat16", *, split: bool | None = None,
                  block_k: int = kvcache.DEFAULT_BLOCK_K) -> dict[str, float]:
    """Bytes per chip: {"weights", "sliding_kv", "global_kv", "total"}. `split` defaults to the engine's
    rule (split-cache above 32K context)."""
    if split is None:
        split = max_model_len > 32 * 1024 and any(cfg.is_sliding(i) for i in range(cfg.num_layers))
    itemsize = jnp.dtype(weight_dtype).itemsize
    weights = 0.0
    for p in jax.tree.leaves(family(cfg.family).specs(cfg), is_leaf=is_param):
        ways = tp if MODEL in partition_spec(p.axes, p.shape, {MODEL: tp}, cfg) else 1
        weights += math.prod(p.shape) * itemsize / ways
    kv = kvcache.cache_bytes(cfg, batch, max_model_len, kv_dtype, split=split, block_k=block_k, tp=tp)
    return {"weights": weights, "sliding_kv": kv["sliding"], "global_kv": kv["global"],
            "total": weights + kv["sliding"] + kv["global"]}
