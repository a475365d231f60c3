"""Block-by-block and whole-model parity with HF transformers on tiny random configs.

Tolerances: float32 everywhere; XLA and torch order reductions differently, so values agree to
~1e-5 relative. We assert max abs diff <= 1e-4 on logits of magnitude ~1-10."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from rvjax.cache import new_cache  # noqa: E402
from rvjax.models import family, layers  # noqa: E402
from rvjax.weights.hf_dir import read_hf_dir  # noqa: E402
from tests.tiny import gemma3_config, qwen2_config, random_model  # noqa: E402

TOL = 1e-4


def _ours(tmp_path, hf_model):
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, w = read_hf_dir(tmp_path)
    return cfg, jax.tree.map(jnp.asarray, w)


def _forward_logits(cfg, w, tokens, kv="float32"):
    b, t = tokens.shape
    cache = new_cache(cfg, b, max(t, 16), kv)
    mod = family(cfg.family)
    h, _ = mod.forward(w, cfg, jnp.asarray(tokens), jnp.zeros(b, jnp.int32), cache)
    return np.asarray(mod.logits(w, cfg, h))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


MODELS = {
    "qwen2": lambda: qwen2_config(),
    "qwen2-tied": lambda: qwen2_config(tie_word_embeddings=True),
    "gemma3": lambda: gemma3_config(),
    "gemma3-softcap": lambda: gemma3_config(final_logit_softcapping=5.0, attn_logit_softcapping=3.0),
}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    hf = random_model(MODELS[request.param](), seed=len(request.param))
    cfg, w = _ours(tmp_path_factory.mktemp(request.param), hf)
    return request.param, hf, cfg, w


def test_config_read_from_hf(pair):
    name, hf, cfg, _ = pair
    c = hf.config
    assert cfg.num_layers == c.num_hidden_layers and cfg.num_kv_heads == c.num_key_value_heads
    assert cfg.tie_embeddings == c.tie_word_embeddings
    if name.startswith("gemma3"):
        assert [cfg.is_sliding(i) for i in range(cfg.num_layers)] == [t == "sliding_attention" for t in c.layer_types]
        assert cfg.sliding_window == c.sliding_window
        assert cfg.final_logit_softcap == c.final_logit_softcapping


def test_whole_model_logits(pair):
    _, hf, cfg, w = pair
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 13))
    ours, ref = _forward_logits(cfg, w, tokens), _hf_logits(hf, tokens)
    assert np.abs(ours - ref).max() <= TOL, np.abs(ours - ref).max()


def test_each_block_cumulatively(pair):
    """Layer by layer: the first L blocks of ours against the first L blocks of HF's."""
    _, hf, cfg, w = pair
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 11))
    all_layers = hf.model.layers
    try:
        for n in range(1, cfg.num_layers + 1):
            hf.model.layers = all_layers[:n]
            hf.config.num_hidden_layers = n
            sub_cfg = dataclasses.replace(cfg, num_layers=n)
            sub_w = dataclasses.replace(w, layers=w.layers[:n])
            diff = np.abs(_forward_logits(sub_cfg, sub_w, tokens) - _hf_logits(hf, tokens)).max()
            assert diff <= TOL, f"block {n - 1}: max abs diff {diff}"
    finally:
        hf.model.layers = all_layers
        hf.config.num_hidden_layers = len(all_layers)


def test_mlp_and_norm_modules(pair):
    name, hf, cfg, w = pair
    layer = hf.model.layers[0]
    x = np.random.default_rng(2).standard_normal((2, 5, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        ref_norm = layer.input_layernorm(torch.tensor(x)).numpy()
        ref_mlp = layer.mlp(torch.tensor(x)).numpy()
    p = w.layers[0]
    ours_norm = np.asarray(layers.rms_norm(jnp.asarray(x), p.attn_norm, cfg.rms_eps))
    act = "gelu_tanh" if name.startswith("gemma3") else "silu"
    ours_mlp = np.asarray(layers.gated_mlp(jnp.asarray(x), p.gate, p.up, p.down, act))
    assert np.abs(ours_norm - ref_norm).max() <= 1e-5
    assert np.abs(ours_mlp - ref_mlp).max() <= 1e-5


@pytest.mark.parametrize("theta", [10_000.0, 1_000_000.0])
def test_rope_matches_hf(theta):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

    cfg = qwen2_config(rope_theta=theta)
    rot = Qwen2RotaryEmbedding(cfg)
    q = np.random.default_rng(3).standard_normal((1, 4, 300, 16)).astype(np.float32)  # [B, N, T, H]
    pos = torch.arange(300)[None]
    cos, sin = rot(torch.tensor(q), pos)
    ref, _ = apply_rotary_pos_emb(torch.tensor(q), torch.tensor(q), cos, sin)
    ours = layers.rope(jnp.asarray(q.transpose(0, 2, 1, 3)), jnp.asarray(pos.numpy()), theta)
    assert np.abs(np.asarray(ours).transpose(0, 2, 1, 3) - ref.numpy()).max() <= 2e-5


@pytest.mark.parametrize("kv,tol", [("float32", TOL), ("int8", 0.05)])
def test_incremental_decode_matches_full_forward(pair, kv, tol):
    """Prefill a prefix, then feed tokens one at a time through the cache: logits equal the full forward.
    Catches stale or misplaced cache writes; int8 KV only to its quantization error."""
    _, _, cfg, w = pair
    mod = family(cfg.family)
    tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 12))
    full = _forward_logits(cfg, w, tokens)
    cache = new_cache(cfg, 2, 16, kv)
    h, cache = mod.forward(w, cfg, jnp.asarray(tokens[:, :5]), jnp.zeros(2, jnp.int32), cache)
    steps = [np.asarray(mod.logits(w, cfg, h))]
    for t in range(5, 12):
        h, cache = mod.forward(w, cfg, jnp.asarray(tokens[:, t:t + 1]), jnp.full(2, t, jnp.int32), cache)
        steps.append(np.asarray(mod.logits(w, cfg, h)))
    inc = np.concatenate(steps, axis=1)
    assert np.abs(inc - full).max() <= tol, np.abs(inc - full).max()


def test_eval_shape_full_size_configs():
    """Full-size Qwen2.5-0.5B and Gemma 3 270M shapes, checked without memory."""
    from rvjax.config import ModelConfig
    from rvjax.models.params import abstract, is_param

    sizes = {
        "qwen2": ModelConfig(family="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                             num_kv_heads=2, head_dim=64, intermediate_size=4864, qkv_bias=True,
                             tie_embeddings=True, rope_theta=1e6),
        "gemma3": ModelConfig(family="gemma3", vocab_size=262144, hidden_size=640, num_layers=18, num_heads=4,
                              num_kv_heads=1, head_dim=256, intermediate_size=2048, sliding_window=512,
                              sliding_pattern=6, query_pre_attn_scalar=256, rope_theta=1e6),
    }
    expected_params = {"qwen2": 494_032_768, "gemma3": 268_098_176}
    for name, cfg in sizes.items():
        mod = family(cfg.family)
        specs = mod.specs(cfg)
        n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(specs, is_leaf=is_param))
        assert n == expected_params[name], (name, n)
        out = jax.eval_shape(lambda w, t, c: mod.forward(w, cfg, t, jnp.zeros(2, jnp.int32), c)[0],
                             abstract(specs), jax.ShapeDtypeStruct((2, 7), jnp.int32),
                             jax.eval_shape(lambda: new_cache(cfg, 2, 64, "float32")))
        assert out.shape == (2, 7, cfg.hidden_size)
