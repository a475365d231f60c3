"""Gemma 3 text: 5:1 sliding/global layers (RoPE 10k local, 1M global), QK-norm, pre- and post-norms
around attention and MLP, sqrt(D)-scaled embeddings, `query_pre_attn_scalar`, GELU-tanh MLP, tied head.

Norm scales are held as the multiplier: HF's `(1 + w)` is folded in by the HF loader, GGUF stores it
already (llama.cpp's converter adds the 1), so nothing here adds it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rvjax.cache import KVCache
from rvjax.config import ModelConfig
from rvjax.models.layers import attention_block, gated_mlp, rms_norm, tied_logits
from rvjax.models.params import Param


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    attn_norm: jax.Array  # [D]
    q: jax.Array  # [N*H, D]   (matrices are [out, in], as checkpoints store them)
    k: jax.Array  # [K*H, D]
    v: jax.Array  # [K*H, D]
    o: jax.Array  # [D, N*H]
    q_norm: jax.Array  # [H]
    k_norm: jax.Array  # [H]
    post_attn_norm: jax.Array  # [D]
    mlp_norm: jax.Array  # [D]
    gate: jax.Array  # [F, D]
    up: jax.Array  # [F, D]
    down: jax.Array  # [D, F]
    post_mlp_norm: jax.Array  # [D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # [V, D], also the output head
    layers: list[Layer]
    final_norm: jax.Array  # [D]


def specs(cfg: ModelConfig) -> Weights:
    d, f, v, h = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    nh, kh = cfg.num_heads * h, cfg.num_kv_heads * h
    if not cfg.tie_embeddings:
        raise ValueError("Gemma 3 ties its output head to the embedding; got tie_embeddings=False")

    def layer():
        norm = lambda n: Param((n,), ("embed" if n == d else "head_dim",), "ones")  # noqa: E731
        return Layer(
            attn_norm=norm(d),
            q=Param((nh, d), ("q_heads", "embed")),
            k=Param((kh, d), ("kv_heads", "embed")),
            v=Param((kh, d), ("kv_heads", "embed")),
            o=Param((d, nh), ("embed", "q_heads")),
            q_norm=norm(h),
            k_norm=norm(h),
            post_attn_norm=norm(d),
            mlp_norm=norm(d),
            gate=Param((f, d), ("ffn", "embed")),
            up=Param((f, d), ("ffn", "embed")),
            down=Param((d, f), ("embed", "ffn")),
            post_mlp_norm=norm(d),
        )

    return Weights(embed=Param((v, d), ("vocab", "embed")), layers=[layer() for _ in range(cfg.num_layers)],
                   final_norm=Param((d,), ("embed",), "ones"))


def forward(w: Weights, cfg: ModelConfig, tokens: jax.Array, start: jax.Array, cache: KVCache, valid=None):
    """tokens [B, T] at positions start[b] + t -> final hidden states [B, T, D] and the updated cache.
    valid [B] (optional): the real tokens of each row of a padded prefill chunk."""
    positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    x = jnp.take(w.embed, tokens, axis=0)
    # HF multiplies by sqrt(D) cast to the weight dtype (in bf16 sqrt(640) = 25.25, not 25.298).
    x = x * jnp.asarray(cfg.hidden_size ** 0.5, dtype=x.dtype)
    new_layers = []
    for i, (p, layer_kv) in enumerate(zip(w.layers, cache.layers)):
        h, layer_kv = attention_block(
            rms_norm(x, p.attn_norm, cfg.rms_eps), p, layer_kv, start, positions,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            theta=cfg.layer_rope_theta(i), scale=cfg.attn_scale, eps=cfg.rms_eps,
            window=cfg.layer_window(i), softcap=cfg.attn_logit_softcap, valid=valid)
        x = x + rms_norm(h, p.post_attn_norm, cfg.rms_eps)
        h = gated_mlp(rms_norm(x, p.mlp_norm, cfg.rms_eps), p.gate, p.up, p.down, "gelu_tanh")
        x = x + rms_norm(h, p.post_mlp_norm, cfg.rms_eps)
        new_layers.append(layer_kv)
    return rms_norm(x, w.final_norm, cfg.rms_eps), KVCache(new_layers, cache.max_len)


logits = tied_logits


HF_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.q",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.k",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.v",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.o",
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.q_norm",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.k_norm",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attn_norm",
    "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.mlp_norm",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.gate",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.up",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.down",
    "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_mlp_norm",
}

GGUF_NAMES = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm",
    "blk.{i}.attn_q.weight": "layers.{i}.q",
    "blk.{i}.attn_k.weight": "layers.{i}.k",
    "blk.{i}.attn_v.weight": "layers.{i}.v",
    "blk.{i}.attn_output.weight": "layers.{i}.o",
    "blk.{i}.attn_q_norm.weight": "layers.{i}.q_norm",
    "blk.{i}.attn_k_norm.weight": "layers.{i}.k_norm",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attn_norm",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm",
    "blk.{i}.ffn_gate.weight": "layers.{i}.gate",
    "blk.{i}.ffn_up.weight": "layers.{i}.up",
    "blk.{i}.ffn_down.weight": "layers.{i}.down",
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_mlp_norm",
}

# HF Gemma stores norm weights as w in `x * (1 + w)`; rvjax holds the multiplier.
HF_NORM_OFFSET = 1.0
