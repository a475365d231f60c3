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


class StepView(NamedTuple):
    """What a step's attention reads: the layer's cache as it was before the step, plus the step's own K/V.
    The step's write is separate (`commit`), so a scanned loop can defer it past the loop."""

    layer: Any  # LayerKV | RingKV, before this step's write ([G, ...] when stacked)
    index: Any  # the layer's group in a stacked cache, or None
    k: jax.Array  # [B, T, K, H]: the step's K/V as the cache stores them, dequantized
    v: jax.Array
    start: jax.Array  # [B]: position of the step's first token
    written: bool = False  # the layer already holds the step's K/V (an unrolled write before attention)


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


def _scatter(buf, new, slots, groups: bool = False):
    """buf [B, S, ...] <- new [B, T, ...] at slots [B, T]; with `groups`, buf [G, B, S, ...] <- new
    [G, B, T, ...] for every group at once. Out-of-range slots are dropped."""
    rows = jnp.broadcast_to(jnp.arange(slots.shape[0])[:, None], slots.shape)
    if groups:
        g = jnp.arange(buf.shape[0])[:, None, None]
        at = (g, rows[None], slots[None])
    else:
        at = (rows, slots)
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


def stage(layer, k: jax.Array, v: jax.Array, start: jax.Array, *, index=None):
    """The step's k, v [B, T, K, H] (positions start[b] + t) as the layer stores them: (view for `attend`,
    parts for `commit`). index: the layer's group when the cache is stacked for a scanned loop."""
    parts = _stored(layer, k, v)
    view = StepView(layer, index, _dequant(parts[0], parts[2], k.dtype), _dequant(parts[1], parts[3], k.dtype),
                    start)
    return view, parts


def commit(layer, parts, start: jax.Array, *, valid=None, groups: bool = False):
    """Write staged parts into the layer. With `groups`, the layer is stacked [G, ...] and the parts carry
    every group's K/V [G, B, T, ...] (a scanned loop's outputs): one write after the loop, not one per
    iteration (inside the loop, the TPU compiler copies the whole buffer to scatter into it).
    valid [B] (optional): how many of the T tokens are real (the rest pad a prefill chunk)."""
    t = parts[0].shape[-3]
    if isinstance(layer, RingKV):
        slots = _ring_slots(start, t, layer.size, valid)
        return _replace(layer, parts, lambda buf, x: _scatter(buf, x, slots, groups))
    if groups:
        slots = start[:, None] + jnp.arange(t)[None, :]
        return _replace(layer, parts, lambda buf, x: _scatter(buf, x, slots, True))
    return _replace(layer, parts, lambda buf, x: _write_rows(buf, x, start))


def update(layer, k: jax.Array, v: jax.Array, start: jax.Array, *, valid=None):
    """stage + commit: write k, v [B, T, K, H] at positions start[b] + t; returns (new layer, view).

    A whole-context layer is read after its write: reading the old buffer while it is updated in place
    makes XLA copy the whole cache (every layer, every step). A ring is read before its write, since the
    write may overwrite entries the step still needs."""
    view, parts = stage(layer, k, v, start)
    new = commit(layer, parts, start, valid=valid)
    return new, view if isinstance(layer, RingKV) else view._replace(layer=new, written=True)


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


def attend(view: StepView, q: jax.Array, q_pos: jax.Array, *, scale: float, window: int | None = None,
           softcap: float | None = None) -> jax.Array:
    """Attention of q [B, T, N, H] at q_pos [B, T] over a step's view: the cache entries before the step
    and the step's own K/V. [B, T, N, H]."""
    layer, index, k_new, v_new, start = view.layer, view.index, view.k, view.v, view.start
    dtype = q.dtype
    t = k_new.shape[1]
    own = (k_new.astype(dtype), v_new.astype(dtype), start[:, None] + jnp.arange(t)[None, :])
    if view.written:  # the cache holds the step's K/V already: read it up to the step's last position
        own, start = None, start + t
    if isinstance(layer, RingKV):
        assert own is not None, "a ring is read before its write"
        if window is None or layer.size > window:
            raise ValueError(f"a ring of {layer.size} slots serves sliding windows of at least that size; "
                             f"got window={window}")
        k, v = _read(layer, index, dtype)
        return xla.dense(q, q_pos, [(k, v, ring_positions(start, layer.size)), own], scale=scale, window=window,
                         softcap=softcap)
    if layer.block is None:
        k, v = _read(layer, index, dtype)
        cached = (k, v, _before(jnp.arange(k.shape[1]), start))
        return xla.dense(q, q_pos, [cached] if own is None else [cached, own], scale=scale, window=window,
                         softcap=softcap)
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
        return (_dequant(sl(layer.k), sl(layer.k_scale), dtype), _dequant(sl(layer.v), sl(layer.v_scale), dtype),
                _before(i * block + jnp.arange(block), start))

    num_blocks = (jnp.max(start) + block - 1) // block  # blocks holding any position before `start`
    return xla.blockwise(q, q_pos, read_block, num_blocks, block, layer.k.shape[-2], extra=own, scale=scale,
                         window=window, softcap=softcap)


def _before(pos: jax.Array, start: jax.Array) -> jax.Array:
    """[B, S] key positions of cache slots pos [S], -1 at or after `start` (not written, or stale)."""
    return jnp.where(pos[None, :] < start[:, None], pos[None, :], -1)
