"""Qwen2 / Qwen2.5: pre-norm decoder, GQA with q/k/v biases, SiLU-gated MLP, optional tied head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rvjax.cache import KVCache
from rvjax.config import ModelConfig
from rvjax.models.layers import attention_block, gated_mlp, rms_norm
from rvjax.models.params import Param


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    attn_norm: jax.Array  # [D]
    q: jax.Array  # [N*H, D]   (matrices are [out, in], as checkpoints store them)
    k: jax.Array  # [K*H, D]
    v: jax.Array  # [K*H, D]
    o: jax.Array  # [D, N*H]
    q_bias: jax.Array  # [N*H]
    k_bias: jax.Array  # [K*H]
    v_bias: jax.Array  # [K*H]
    mlp_norm: jax.Array  # [D]
    gate: jax.Array  # [F, D]
    up: jax.Array  # [F, D]
    down: jax.Array  # [D, F]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # [V, D]
    layers: list[Layer]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [V, D]; None when tied to `embed`


def specs(cfg: ModelConfig) -> Weights:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, kh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def layer():
        return Layer(
            attn_norm=Param((d,), ("embed",), "ones"),
            q=Param((nh, d), ("q_heads", "embed")),
            k=Param((kh, d), ("kv_heads", "embed")),
            v=Param((kh, d), ("kv_heads", "embed")),
            o=Param((d, nh), ("embed", "q_heads")),
            q_bias=Param((nh,), ("q_heads",)),
            k_bias=Param((kh,), ("kv_heads",)),
            v_bias=Param((kh,), ("kv_heads",)),
            mlp_norm=Param((d,), ("embed",), "ones"),
            gate=Param((f, d), ("ffn", "embed")),
            up=Param((f, d), ("ffn", "embed")),
            down=Param((d, f), ("embed", "ffn")),
        )

    return Weights(
        embed=Param((v, d), ("vocab", "embed")),
        layers=[layer() for _ in range(cfg.num_layers)],
        final_norm=Param((d,), ("embed",), "ones"),
        lm_head=None if cfg.tie_embeddings else Param((v, d), ("vocab", "embed")),
    )


def forward(w: Weights, cfg: ModelConfig, tokens: jax.Array, start: jax.Array, cache: KVCache, valid=None):
    """tokens [B, T] at positions start[b] + t -> final hidden states [B, T, D] and the updated cache.
    valid [B] (optional): the real tokens of each row of a padded prefill chunk."""
    positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    x = jnp.take(w.embed, tokens, axis=0)
    new_layers = []
    # Unrolled Python loop: XLA:CPU copies scanned weight slices (DESIGN.md), unrolled it does not.
    for p, layer_kv in zip(w.layers, cache.layers):
        h, layer_kv = attention_block(
            rms_norm(x, p.attn_norm, cfg.rms_eps), p, layer_kv, start, positions,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            theta=cfg.rope_theta, scale=cfg.attn_scale, eps=cfg.rms_eps, valid=valid)
        x = x + h
        x = x + gated_mlp(rms_norm(x, p.mlp_norm, cfg.rms_eps), p.gate, p.up, p.down, "silu")
        new_layers.append(layer_kv)
    return rms_norm(x, w.final_norm, cfg.rms_eps), KVCache(new_layers, cache.max_len)


def logits(w: Weights, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """h [..., D] -> float32 logits [..., V]."""
    head = w.embed if w.lm_head is None else w.lm_head
    return jnp.einsum("...d,vd->...v", h, head, preferred_element_type=jnp.float32)


# Checkpoint names -> canonical names (rvjax.models.params.flat_names). `{i}` is the layer index.
HF_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.q",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.k",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.v",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.o",
    "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.q_bias",
    "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.k_bias",
    "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.v_bias",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.gate",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.up",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.down",
}

GGUF_NAMES = {
    "token_embd.weight": "embed",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm",
    "blk.{i}.attn_q.weight": "layers.{i}.q",
    "blk.{i}.attn_k.weight": "layers.{i}.k",
    "blk.{i}.attn_v.weight": "layers.{i}.v",
    "blk.{i}.attn_output.weight": "layers.{i}.o",
    "blk.{i}.attn_q.bias": "layers.{i}.q_bias",
    "blk.{i}.attn_k.bias": "layers.{i}.k_bias",
    "blk.{i}.attn_v.bias": "layers.{i}.v_bias",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm",
    "blk.{i}.ffn_gate.weight": "layers.{i}.gate",
    "blk.{i}.ffn_up.weight": "layers.{i}.up",
    "blk.{i}.ffn_down.weight": "layers.{i}.down",
}

# HF stores norms as the multiplier itself (no Gemma-style `1 + w`).
HF_NORM_OFFSET = 0.0
