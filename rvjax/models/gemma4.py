"""Gemma 4 text (31B dense, E2B, E4B), checked against HF transformers' `modeling_gemma4.py`.

Every layer: pre/post RMSNorms around attention and MLP (plain `w`, not Gemma 3's `1 + w`), QK-norm, a
scale-free v-norm, attention scale 1.0, a GELU-tanh gated MLP, and a learned `layer_scalar` on its output.
Sliding layers use RoPE θ=1e4 over their head dim; global layers have their own head dim and KV heads,
proportional partial RoPE (θ=1e6, a quarter of each half rotated), and with k_eq_v no v projection: V is
the raw K projection through the v-norm. E2B/E4B add per-layer input embeddings (PLE), KV sharing (the
last layers attend over the K/V of the last earlier layer of their type) and a double-wide MLP there.

The layer loop is either unrolled (XLA:CPU copies scanned weight slices: DESIGN.md) or a `lax.scan` over
groups of layers whose body runs a whole group, e.g. five sliding layers then one global, with no
`lax.cond` (rvLLM §8.2, "10 groups of 6"). `layout` says how the layers split into scanned segments."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rvjax.cache import kv as kvcache
from rvjax.cache.kv import KVCache
from rvjax.config import ModelConfig, from_hf_config
from rvjax.models.layers import gated_mlp, linear, rms_norm, rope, tied_logits
from rvjax.models.params import Param


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    attn_norm: jax.Array  # [D]
    q: jax.Array  # [N*H, D]   (H: this layer's head dim)
    o: jax.Array  # [D, N*H]
    q_norm: jax.Array  # [H]
    post_attn_norm: jax.Array  # [D]
    mlp_norm: jax.Array  # [D]
    gate: jax.Array  # [F, D]
    up: jax.Array  # [F, D]
    down: jax.Array  # [D, F]
    post_mlp_norm: jax.Array  # [D]
    scalar: jax.Array  # [1], HF's `layer_scalar` buffer
    k: jax.Array | None = None  # [K*H, D]; None on KV-shared layers
    v: jax.Array | None = None  # [K*H, D]; None on KV-shared and k_eq_v layers
    k_norm: jax.Array | None = None  # [H]
    ple_gate: jax.Array | None = None  # [P, D]  per-layer input (E2B/E4B)
    ple_proj: jax.Array | None = None  # [D, P]
    ple_norm: jax.Array | None = None  # [D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # [V, D], also the output head
    final_norm: jax.Array  # [D]
    blocks: list[list[Layer]]  # one list per `Segment`; a scanned segment's layers are stacked [count, ...]
    ple_embed: jax.Array | None = None  # [Vp, L*P]
    ple_model_proj: jax.Array | None = None  # [L*P, D]
    ple_model_norm: jax.Array | None = None  # [P]
    scanned: bool = dataclasses.field(default=False, metadata=dict(static=True))


VARIANTS_FILE = Path(__file__).parent / "data" / "gemma4_text_configs.json"  # sources: data/README.md


def variant(name: str) -> ModelConfig:
    """The full-size text config of a released Gemma 4 ("gemma-4-31b", "gemma-4-e2b", "gemma-4-e4b")."""
    known = json.loads(VARIANTS_FILE.read_text())
    if name not in known:
        raise ValueError(f"unknown Gemma 4 variant {name!r}; known: {sorted(known)}")
    return from_hf_config(known[name])


class Segment(NamedTuple):
    """Layers first .. first + period*count - 1: `count` repeats of a group of `period` layers."""

    first: int
    period: int
    count: int
    scanned: bool


def layout(cfg: ModelConfig, scan: bool) -> tuple[Segment, ...]:
    """How the layer loop runs. Unrolled: one segment of every layer. Scanned: the non-shared and the
    KV-shared layers each split into the shortest repeating group (31B: 10 groups of 5 sliding + 1
    global). With KV sharing, the last non-shared group runs unrolled: its K/V views feed the shared layers."""
    if not scan:
        return (Segment(0, cfg.num_layers, 1, False),)
    first_shared = cfg.num_layers - cfg.kv_shared_layers
    out = []
    for lo, hi in ((0, first_shared), (first_shared, cfg.num_layers)):
        n = hi - lo
        if n == 0:
            continue
        kinds = [cfg.is_sliding(i) for i in range(lo, hi)]
        period = next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
        count = n // period
        keep_last = 1 if cfg.kv_shared_layers and lo == 0 else 0  # producers of the shared K/V
        if count - keep_last > 1:
            out.append(Segment(lo, period, count - keep_last, True))
            if keep_last:
                out.append(Segment(lo + period * (count - 1), period, 1, False))
        else:
            out.append(Segment(lo, period, count, False))
    return tuple(out)


def specs(cfg: ModelConfig) -> Weights:
    """Declarations in the unrolled layout (one segment, one entry per layer)."""
    d, v, p = cfg.hidden_size, cfg.vocab_size, cfg.ple_dim
    if not cfg.tie_embeddings:
        raise ValueError("Gemma 4 ties its output head to the embedding; got tie_embeddings=False")
    norm = lambda n, axis="embed": Param((n,), (axis,), "ones")  # noqa: E731

    def layer(i):
        h, kh, f = cfg.layer_head_dim(i), cfg.layer_kv_heads(i), cfg.layer_ffn(i)
        shared = cfg.kv_shared(i)
        return Layer(
            attn_norm=norm(d),
            q=Param((cfg.num_heads * h, d), ("q_heads", "embed")),
            o=Param((d, cfg.num_heads * h), ("embed", "q_heads")),
            q_norm=norm(h, "head_dim"),
            post_attn_norm=norm(d),
            mlp_norm=norm(d),
            gate=Param((f, d), ("ffn", "embed")),
            up=Param((f, d), ("ffn", "embed")),
            down=Param((d, f), ("embed", "ffn")),
            post_mlp_norm=norm(d),
            scalar=Param((1,), (None,), "ones"),
            k=None if shared else Param((kh * h, d), ("kv_heads", "embed")),
            v=None if shared or not cfg.layer_has_v(i) else Param((kh * h, d), ("kv_heads", "embed")),
            k_norm=None if shared else norm(h, "head_dim"),
            ple_gate=Param((p, d), (None, "embed")) if p else None,
            ple_proj=Param((d, p), ("embed", None)) if p else None,
            ple_norm=norm(d) if p else None,
        )

    return Weights(
        embed=Param((v, d), ("vocab", "embed")),
        final_norm=norm(d),
        blocks=[[layer(i) for i in range(cfg.num_layers)]],
        ple_embed=Param((cfg.ple_vocab, cfg.num_layers * p), ("vocab", None)) if p else None,
        ple_model_proj=Param((cfg.num_layers * p, d), (None, "embed")) if p else None,
        ple_model_norm=norm(p, None) if p else None,
    )


def to_layout(w: Weights, cfg: ModelConfig, scan: bool) -> Weights:
    """Weights in the unrolled layout -> the layout of `layout(cfg, scan)` (stacking scanned groups)."""
    assert not w.scanned and len(w.blocks) == 1, "to_layout takes the unrolled layout"
    layers = w.blocks[0]
    blocks = []
    for seg in layout(cfg, scan):
        if seg.scanned:
            blocks.append([jax.tree.map(lambda *xs: jnp.stack(xs),
                                        *[layers[seg.first + g * seg.period + j] for g in range(seg.count)])
                           for j in range(seg.period)])
        else:
            blocks.append(layers[seg.first: seg.first + seg.period * seg.count])
    return dataclasses.replace(w, blocks=blocks, scanned=scan)


def new_cache(cfg: ModelConfig, w_or_scan, batch: int, max_len: int, dtype: str, **kw) -> KVCache:
    """A cache laid out like the weights (`Weights` or a scan flag)."""
    scan = w_or_scan.scanned if isinstance(w_or_scan, Weights) else bool(w_or_scan)
    return kvcache.new_cache(cfg, batch, max_len, dtype, layout=layout(cfg, scan), **kw)


def _per_layer_inputs(w: Weights, cfg: ModelConfig, tokens, x):
    """[B, T, L, P]: the token's own per-layer embedding plus a projection of the input embedding,
    (norm(proj(x) / sqrt(D)) + embed_pl(token) * sqrt(P)) / sqrt(2) (HF `project_per_layer_inputs`)."""
    b, t = tokens.shape
    n, p = cfg.num_layers, cfg.ple_dim
    own = jnp.take(w.ple_embed, tokens, axis=0) * jnp.asarray(p ** 0.5, w.ple_embed.dtype)
    proj = linear(x, w.ple_model_proj) * (cfg.hidden_size ** -0.5)
    proj = rms_norm(proj.reshape(b, t, n, p), w.ple_model_norm, cfg.rms_eps)
    return (proj + own.reshape(b, t, n, p)) * (2.0 ** -0.5)


def _layer(p: Layer, cfg: ModelConfig, i: int, x, ple_i, layer_kv, views: dict, *, start, positions, valid,
           index=None):
    """One decoder layer; i is the layer (or, in a scanned group, a representative of its position).
    Returns (x, the layer's updated cache) or, inside a scan (index = the group), (x, the staged K/V)."""
    b, t, _ = x.shape
    h_dim, sliding = cfg.layer_head_dim(i), cfg.is_sliding(i)
    inv_freq = cfg.layer_inv_freq(i)
    h = rms_norm(x, p.attn_norm, cfg.rms_eps)
    q = rms_norm(linear(h, p.q).reshape(b, t, cfg.num_heads, h_dim), p.q_norm, cfg.rms_eps)
    q = rope(q, positions, inv_freq=inv_freq)
    if cfg.kv_shared(i):
        view = views[sliding]
    else:
        kh = cfg.layer_kv_heads(i)
        k = linear(h, p.k).reshape(b, t, kh, h_dim)
        v = k if p.v is None else linear(h, p.v).reshape(b, t, kh, h_dim)
        k = rope(rms_norm(k, p.k_norm, cfg.rms_eps), positions, inv_freq=inv_freq)
        v = rms_norm(v, None, cfg.rms_eps)
        if index is None:
            layer_kv, view = kvcache.update(layer_kv, k, v, start, valid=valid)
            views[sliding] = view
        else:
            view, layer_kv = kvcache.stage(layer_kv, k, v, start, index=index)  # written after the loop
    out = kvcache.attend(view, q, positions, scale=cfg.attn_scale, window=cfg.layer_window(i))
    x = x + rms_norm(linear(out.reshape(b, t, -1), p.o), p.post_attn_norm, cfg.rms_eps)
    h = gated_mlp(rms_norm(x, p.mlp_norm, cfg.rms_eps), p.gate, p.up, p.down, "gelu_tanh")
    x = x + rms_norm(h, p.post_mlp_norm, cfg.rms_eps)
    if ple_i is not None:
        g = jax.nn.gelu(linear(x, p.ple_gate), approximate=True) * ple_i
        x = x + rms_norm(linear(g, p.ple_proj), p.ple_norm, cfg.rms_eps)
    return x * p.scalar.astype(x.dtype), layer_kv


def forward(w: Weights, cfg: ModelConfig, tokens: jax.Array, start: jax.Array, cache: KVCache, valid=None):
    """tokens [B, T] at positions start[b] + t -> final hidden states [B, T, D] and the updated cache.
    valid [B] (optional): the real tokens of each row of a padded prefill chunk."""
    positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    x = jnp.take(w.embed, tokens, axis=0)
    # HF multiplies by sqrt(D) cast to the weight dtype (in bf16 sqrt(5376) = 73.5, not 73.32).
    x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype=x.dtype)
    ple = _per_layer_inputs(w, cfg, tokens, x) if cfg.ple_dim else None
    views: dict[bool, object] = {}  # is_sliding -> the K/V view of the last layer of that type
    kw = dict(start=start, positions=positions, valid=valid)
    new_blocks = []
    for seg, params, caches in zip(layout(cfg, w.scanned), w.blocks, cache.layers):
        if not seg.scanned:
            out = []
            for j, (p, layer_kv) in enumerate(zip(params, caches)):
                i = seg.first + j
                x, layer_kv = _layer(p, cfg, i, x, None if ple is None else ple[:, :, i], layer_kv, views, **kw)
                out.append(layer_kv)
            new_blocks.append(out)
            continue
        span = ple[:, :, seg.first: seg.first + seg.period * seg.count] if ple is not None else None
        # [count, B, T, period, P]: each scan step gets its group's per-layer inputs.
        xs_ple = None if span is None else jnp.moveaxis(
            span.reshape(span.shape[:2] + (seg.count, seg.period, cfg.ple_dim)), 2, 0)

        def group(x, xs, seg=seg, caches=caches):
            params, g, ple_g = xs
            staged = []
            for j in range(seg.period):
                x, kv = _layer(params[j], cfg, seg.first + j, x, None if ple_g is None else ple_g[:, :, j],
                               caches[j], views, index=g, **kw)
                staged.append(kv)
            return x, staged

        # Inside the loop the caches are only read; every group's new K/V comes out of the scan [count, ...]
        # and is written once after it (scattering in the loop makes the TPU compiler copy whole buffers).
        x, staged = jax.lax.scan(group, x, (params, jnp.arange(seg.count), xs_ple))
        new_blocks.append([None if c is None else kvcache.commit(c, parts, start, valid=valid, groups=True)
                           for c, parts in zip(caches, staged)])
    return rms_norm(x, w.final_norm, cfg.rms_eps), KVCache(new_blocks, cache.max_len)


logits = tied_logits


_L = "model.layers.{i}."
HF_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "model.embed_tokens_per_layer.weight": "ple_embed",
    "model.per_layer_model_projection.weight": "ple_model_proj",
    "model.per_layer_projection_norm.weight": "ple_model_norm",
    **{_L + ckpt: "blocks.0.{i}." + ours for ckpt, ours in {
        "input_layernorm.weight": "attn_norm",
        "self_attn.q_proj.weight": "q",
        "self_attn.k_proj.weight": "k",
        "self_attn.v_proj.weight": "v",
        "self_attn.o_proj.weight": "o",
        "self_attn.q_norm.weight": "q_norm",
        "self_attn.k_norm.weight": "k_norm",
        "post_attention_layernorm.weight": "post_attn_norm",
        "pre_feedforward_layernorm.weight": "mlp_norm",
        "mlp.gate_proj.weight": "gate",
        "mlp.up_proj.weight": "up",
        "mlp.down_proj.weight": "down",
        "post_feedforward_layernorm.weight": "post_mlp_norm",
        "layer_scalar": "scalar",
        "per_layer_input_gate.weight": "ple_gate",
        "per_layer_projection.weight": "ple_proj",
        "post_per_layer_input_norm.weight": "ple_norm",
    }.items()},
}

# Gemma 4's RMSNorm multiplies by w itself (no Gemma 3 `1 + w`).
HF_NORM_OFFSET = 0.0
# Gemma4ForConditionalGeneration keeps the text model under this prefix, next to the vision and audio towers.
HF_MULTIMODAL_TEXT_PREFIX = "model.language_model."
HF_MULTIMODAL_OTHER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                                "model.embed_audio.")
