"""KV caches, one entry per layer, in two kinds:

- `LayerKV`: every position of the sequence, [B, S, K, H]. Attention over it is dense, or blockwise with
  online softmax when `block` is set (the split-cache global layers, rvLLM §8.2).
- `RingKV`: a sliding-window layer's circular buffer of exactly its window, [B, W, K, H]; position p lives
  in slot p % W, so memory and compute stay O(W) whatever the context (rvLLM §8.2).

Both store float32, bfloat16, or int8 with one float32 scale per (sequence, position, kv head): symmetric
absmax / 127 ("per-head scales", rvLLM §8.8). A layer whose K/V is shared (Gemma 4's last layers) has no
entry (None). Under a scanned layer loop, the caches of one group position are stacked on a leading
[groups] axis and the layer's group is passed as `index`.

`update` writes a layer's new K/V and returns a view; `attend` runs attention over a view. A layer that
reuses another layer's K/V attends over the producer's view."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rvjax.attention import xla
from rvjax.config import ModelConfig
from rvjax.errors import ConfigError

KV_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}
DEFAULT_BLOCK_K = 8192


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerKV:
    k: jax.Array  # [B, S, K, H]  ([G, B, S, K, H] when stacked for a scanned loop)
    v: jax.Array
    k_scale: jax.Array | None = None  # [B, S, K] float32, int8 storage only
    v_scale: jax.Array | None = None
    block: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # blockwise attention

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RingKV:
    k: jax.Array  # [B, W, K, H]: position p in slot p % W
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def size(self) -> int:
        return self.k.shape[-3]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    layers: list[Any]  # LayerKV | RingKV | None per layer; nested lists follow a model's layer layout
    max_len: int = dataclasses.field(metadata=dict(static=True))  # positions a sequence may occupy


class DenseView(NamedTuple):
    layer: LayerKV  # after this step's write
    index: Any


class RingView(NamedTuple):
    ring: RingKV  # before this step's write
    index: Any
    k: jax.Array  # this step's K/V [B, T, K, H], as the cache stores them
    v: jax.Array
    start: jax.Array  # [B] position of the step's first token


def resolve_kv_dtype(name: str, backend: str, split: bool = False) -> str:
    """`auto`: int8 on the split-cache path (rvLLM §8.8); otherwise float32 on CPU (bf16 math is ~20x
    slower on XLA:CPU, DESIGN.md) and bfloat16 elsewhere."""
    if name == "auto":
        return "int8" if split else "float32" if backend == "cpu" else "bfloat16"
    if name not in KV_DTYPES:
        raise ConfigError(f"kv_cache_dtype={name!r} is not one of {['auto', *KV_DTYPES]}")
    return name


# ---- construction ------------------------------------------------------------------------------------


def _arrays(shape, dtype: str):
    quant = dtype == "int8"
    return dict(k=jnp.zeros(shape, KV_DTYPES[dtype]), v=jnp.zeros(shape, KV_DTYPES[dtype]),
                k_scale=jnp.zeros(shape[:-1], jnp.float32) if quant else None,
                v_scale=jnp.zeros(shape[:-1], jnp.float32) if quant else None)


def global_len(max_len: int, block_k: int) -> int:
    """A blockwise layer's buffer: max_len rounded up to whole blocks (one block when it is shorter)."""
    return max_len if max_len <= block_k else math.ceil(max_len / block_k) * block_k


def layer_cache(cfg: ModelConfig, layer: int, batch: int, max_len: int, dtype: str, *, split: bool,
                block_k: int = DEFAULT_BLOCK_K, groups: int | None = None):
    """The cache of one layer (None when it reuses another layer's K/V); `groups` stacks that many."""
    if cfg.kv_shared(layer):
        return None
    lead = () if groups is None else (groups,)
    tail = (cfg.layer_kv_heads(layer), cfg.layer_head_dim(layer))
    window = cfg.layer_window(layer)
    if split and window is not None:
        # A ring smaller than the window is exact while every position fits in it.
        return RingKV(**_arrays(lead + (batch, min(window, max_len)) + tail, dtype))
    if split:
        length = global_len(max_len, block_k)
        return LayerKV(**_arrays(lead + (batch, length) + tail, dtype), block=min(block_k, length))
    return LayerKV(**_arrays(lead + (batch, max_len) + tail, dtype))


def new_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str, *, split: bool = False,
              block_k: int = DEFAULT_BLOCK_K, layout=None) -> KVCache:
    """Zeroed caches for every layer. `layout` (a model's `Segment`s) nests and stacks them to match a
    scanned layer loop; None gives one flat list."""
    make = lambda i, g=None: layer_cache(cfg, i, batch, max_len, dtype, split=split, block_k=block_k,  # noqa: E731
                                         groups=g)
    if layout is None:
        return KVCache([make(i) for i in range(cfg.num_layers)], max_len)
    layers = []
    for seg in layout:
        if seg.scanned:
            layers.append([make(seg.first + j, seg.count) for j in range(seg.period)])
        else:
            layers.append([make(i) for i in range(seg.first, seg.first + seg.period * seg.count)])
    return KVCache(layers, max_len)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: str, *, split: bool = False,
                block_k: int = DEFAULT_BLOCK_K, tp: int = 1) -> dict[str, int]:
    """Bytes of a cache (per chip under TP: a layer's KV heads split when they divide by tp, else they are
    replicated), in sliding and global layers, from its abstract shapes (no allocation)."""
    out = {"sliding": 0, "global": 0}
    for i in range(cfg.num_layers):
        shapes = jax.eval_shape(lambda i=i: layer_cache(cfg, i, batch, max_len, dtype, split=split,
                                                        block_k=block_k))
        n = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
        out["sliding" if cfg.is_sliding(i) else "global"] += n // (1 if cfg.layer_kv_heads(i) % tp else tp)
    return out


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """Bytes one position costs in a contiguous (single-scan) cache."""
    return sum(cache_bytes(cfg, 1, 1, dtype).values())


# ---- writes ------------------------------------------------------------------------------------------


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, K, H] float -> int8 values and per-(B, T, K) scales."""
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    q = jnp.round(x / jnp.where(scale == 0, 1.0, scale)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale.astype(jnp.float32)


def _stored(layer, k, v):
    """(k, v, k_scale, v_scale) as the layer stores them."""
    if layer.quantized:
        kq, ks = _quantize(k)
        vq, vs = _quantize(v)
        return kq, vq, ks, vs
    return k.astype(layer.k.dtype), v.astype(layer.v.dtype), None, None


def _dequant(x, scale, dtype):
    return x.astype(dtype) if scale is None else x.astype(dtype) * scale[..., None].astype(dtype)


def _write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, S, ...] <- new [B, T, ...] at per-row offsets start [B]."""
    def one(b, n, s):
        return jax.lax.dynamic_update_slice_in_dim(b, n, s, axis=0)
    return jax.vmap(one)(buf, new.astype(buf.dtype), start)


def _scatter(buf, new, slots, index):
    """buf [(G,) B, S, ...] <- new [B, T, ...] at slots [B, T] (out-of-range slots are dropped)."""
    rows = jnp.broadcast_to(jnp.arange(slots.shape[0])[:, None], slots.shape)
    at = (rows, slots) if index is None else (index, rows, slots)
    return buf.at[at].set(new.astype(buf.dtype), mode="drop")


def _replace(layer, parts, write):
    k, v, ks, vs = parts
    return dataclasses.replace(layer, k=write(layer.k, k), v=write(layer.v, v),
                               k_scale=None if ks is None else write(layer.k_scale, ks),
                               v_scale=None if vs is None else write(layer.v_scale, vs))


def _ring_slots(start, t: int, size: int, valid):
    """Slots [B, T] of a step's tokens in a ring; tokens past `valid` [B] (prompt padding) and all but the
    last `size` are dropped (slot `size`), so padding never overwrites a live entry."""
    n = jnp.full_like(start, t) if valid is None else valid
    tt = jnp.arange(t)[None, :]
    keep = (tt < n[:, None]) & (tt >= n[:, None] - size)
    return jnp.where(keep, (start[:, None] + tt) % size, size)


def update(layer, k: jax.Array, v: jax.Array, start: jax.Array, *, valid=None, index=None):
    """Write k, v [B, T, K, H] for positions start[b] + t; returns (new layer, view for `attend`).

    valid [B] (optional): how many of the T tokens are real (the rest pad a prefill chunk).
    index: the layer's group when the cache is stacked for a scanned loop."""
    parts = _stored(layer, k, v)
    t = k.shape[1]
    if isinstance(layer, RingKV):
        slots = _ring_slots(start, t, layer.size, valid)
        new = _replace(layer, parts, lambda buf, x: _scatter(buf, x, slots, index))
        dtype = k.dtype
        return new, RingView(layer, index, _dequant(parts[0], parts[2], dtype), _dequant(parts[1], parts[3], dtype),
                             start)
    if index is None:
        new = _replace(layer, parts, lambda buf, x: _write_rows(buf, x, start))
    else:
        slots = start[:, None] + jnp.arange(t)[None, :]
        new = _replace(layer, parts, lambda buf, x: _scatter(buf, x, slots, index))
    return new, DenseView(new, index)


# ---- attention ---------------------------------------------------------------------------------------


def _pick(x, index):
    return x if x is None or index is None else jax.lax.dynamic_index_in_dim(x, index, 0, keepdims=False)


def _read(layer, index, dtype):
    k, v, ks, vs = (_pick(getattr(layer, f), index) for f in ("k", "v", "k_scale", "v_scale"))
    return _dequant(k, ks, dtype), _dequant(v, vs, dtype)


def ring_positions(start: jax.Array, size: int) -> jax.Array:
    """[B, size]: the position each ring slot holds before a step starting at `start`; -1 if empty."""
    last = start[:, None] - 1
    pos = last - (last - jnp.arange(size)[None, :]) % size
    return jnp.where(pos >= 0, pos, -1)


def attend(view, q: jax.Array, q_pos: jax.Array, *, scale: float, window: int | None = None,
           softcap: float | None = None) -> jax.Array:
    """Attention of q [B, T, N, H] at q_pos [B, T] over a layer's view; [B, T, N, H]."""
    dtype = q.dtype
    if isinstance(view, RingView):
        ring = view.ring
        if window is None or ring.size > window:
            raise ValueError(f"a ring of {ring.size} slots serves sliding windows of at least that size; "
                             f"got window={window}")
        rk, rv = _read(ring, view.index, dtype)
        t = view.k.shape[1]
        k_pos = jnp.concatenate([ring_positions(view.start, ring.size),
                                 view.start[:, None] + jnp.arange(t)[None, :]], axis=1)
        keys = jnp.concatenate([rk, view.k.astype(dtype)], axis=1)
        values = jnp.concatenate([rv, view.v.astype(dtype)], axis=1)
        return xla.dense(q, keys, values, q_pos, k_pos, scale=scale, window=window, softcap=softcap)
    layer, index = view
    if layer.block is None:
        k, v = _read(layer, index, dtype)
        k_pos = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32), k.shape[:2])
        return xla.dense(q, k, v, q_pos, k_pos, scale=scale, window=window, softcap=softcap)
    block = layer.block
    lead = () if index is None else (index,)

    def read_block(i):
        def sl(x):
            if x is None:
                return None
            starts = lead + (0, i * block) + (0,) * (x.ndim - 2 - len(lead))
            sizes = (1,) * len(lead) + (x.shape[len(lead)], block) + x.shape[len(lead) + 2:]
            out = jax.lax.dynamic_slice(x, starts, sizes)
            return out[0] if lead else out
        return (_dequant(sl(layer.k), sl(layer.k_scale), dtype), _dequant(sl(layer.v), sl(layer.v_scale), dtype))

    num_blocks = jnp.max(q_pos) // block + 1
    return xla.blockwise(q, q_pos, read_block, num_blocks, block, layer.k.shape[-2], scale=scale, window=window,
                         softcap=softcap)
