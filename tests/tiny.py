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


def gemma4_config(shape: str = "31b", **kw):
    """Tiny Gemma 4 text configs. "31b": dual head dims, k_eq_v, 5:1 pattern, a window shorter than the
    test sequences. "e2b": per-layer inputs, KV sharing over two scanned groups, double-wide MLP."""
    from transformers import Gemma4TextConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16,
                max_position_embeddings=4096, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
                hidden_size_per_layer_input=0)
    if shape == "31b":
        base.update(num_hidden_layers=12, num_key_value_heads=2, global_head_dim=32, num_global_key_value_heads=1,
                    attention_k_eq_v=True, sliding_window=5)
    elif shape == "e2b":
        types = (["sliding_attention"] * 4 + ["full_attention"]) * 5
        base.update(num_hidden_layers=25, layer_types=types, num_key_value_heads=1, global_head_dim=32,
                    sliding_window=6, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                    num_kv_shared_layers=10, use_double_wide_mlp=True)
    else:
        raise ValueError(shape)
    base.update(kw)
    return Gemma4TextConfig(**base)


def random_gemma4(hf_config, seed: int = 0):
    """A random Gemma4ForCausalLM. Norm multipliers stay near 1 and q/k-norms small (~0.35): with unit-scale
    QK-norms these random models are chaotic, and any rounding flips greedy tokens. `layer_scalar` is a
    buffer, so it is randomized separately to prove it is applied."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    hf_config._attn_implementation = "eager"
    model = Gemma4ForCausalLM(hf_config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.35 + 0.05 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model
