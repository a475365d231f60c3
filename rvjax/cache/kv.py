"""Contiguous per-sequence KV cache: one [B, S, K, H] buffer pair per layer.

int8 storage keeps one float32 scale per (sequence, position, kv head): symmetric absmax / 127.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rvjax.config import ModelConfig
from rvjax.errors import ConfigError

KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
    k: jax.Array  # [B, S, K, H]
    v: jax.Array  # [B, S, K, H]
    k_scale: jax.Array | None = None  # [B, S, K] float32, int8 storage only
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    layers: list[LayerKV]

    @property
    def max_len(self) -> int:
        return self.layers[0].k.shape[1]


def resolve_kv_dtype(name: str, backend: str) -> str:
    """`auto` is float32 on CPU (bf16 math is ~20x slower on XLA:CPU, DESIGN.md) and bfloat16 elsewhere."""
    if name == "auto":
        return "float32" if backend == "cpu" else "bfloat16"
    if name not in KV_DTYPES:
        raise ConfigError(f"kv_cache_dtype={name!r} is not one of {['auto', *KV_DTYPES]}")
    return name


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    per_elem = jnp.dtype(KV_DTYPES[dtype]).itemsize
    scales = 2 * cfg.num_kv_heads * 4 if dtype == "int8" else 0
    return cfg.num_layers * (2 * cfg.num_kv_heads * cfg.head_dim * per_elem + scales)


def new_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str) -> KVCache:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    quant = dtype == "int8"

    def layer():
        return LayerKV(
            k=jnp.zeros(shape, KV_DTYPES[dtype]),
            v=jnp.zeros(shape, KV_DTYPES[dtype]),
            k_scale=jnp.zeros(shape[:3], jnp.float32) if quant else None,
            v_scale=jnp.zeros(shape[:3], jnp.float32) if quant else None,
        )

    return KVCache([layer() for _ in range(cfg.num_layers)])


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, K, H] float -> int8 values and per-(B, T, K) scales."""
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    q = jnp.round(x / jnp.where(scale == 0, 1.0, scale)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale.astype(jnp.float32)


def _write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, S, ...] <- new [B, T, ...] at per-row offsets start [B]."""
    def one(b, n, s):
        return jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0)
    return jax.vmap(one)(buf, new.astype(buf.dtype), start)


def write(layer: LayerKV, k: jax.Array, v: jax.Array, start: jax.Array) -> LayerKV:
    """Store k, v [B, T, K, H] at positions start[b] .. start[b] + T - 1 of each row."""
    if not layer.quantized:
        return LayerKV(_write_rows(layer.k, k, start), _write_rows(layer.v, v, start))
    kq, ks = _quantize(k)
    vq, vs = _quantize(v)
    return LayerKV(
        _write_rows(layer.k, kq, start), _write_rows(layer.v, vq, start),
        _write_rows(layer.k_scale, ks, start), _write_rows(layer.v_scale, vs, start),
    )


def read(layer: LayerKV, dtype) -> tuple[jax.Array, jax.Array]:
    """The layer's K and V as `dtype` [B, S, K, H], dequantized when stored as int8."""
    if not layer.quantized:
        return layer.k.astype(dtype), layer.v.astype(dtype)
    return (layer.k.astype(dtype) * layer.k_scale[..., None].astype(dtype),
            layer.v.astype(dtype) * layer.v_scale[..., None].astype(dtype))
