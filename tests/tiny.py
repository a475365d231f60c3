"""Tiny random HF checkpoints for parity tests (HF transformers is the independent reference)."""

from __future__ import annotations

import torch


def qwen2_config(**kw):
    from transformers import Qwen2Config

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rope_theta=10_000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False)
    base.update(kw)
    return Qwen2Config(**base)


def gemma3_config(**kw):
    from transformers import Gemma3TextConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=5,
                query_pre_attn_scalar=24, rms_norm_eps=1e-6, final_logit_softcapping=None,
                attn_logit_softcapping=None)
    base.update(kw)
    return Gemma3TextConfig(**base)


def random_model(hf_config, seed: int = 0):
    """An HF causal LM with every parameter random, norms included (HF inits Gemma norms at zero)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return model
