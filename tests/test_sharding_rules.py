"""Tensor-parallel sharding rules (rvjax/sharding/rules.py) on abstract meshes: no devices needed."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rvjax.config import ModelConfig
from rvjax.models import gemma4, params, qwen2
from rvjax.sharding import cache_shardings, laid_out, param_shardings

TP4 = AbstractMesh((1, 4), ("data", "model"))
DP2_TP2 = AbstractMesh((2, 2), ("data", "model"))
G31 = gemma4.variant("gemma-4-31b")
# Qwen2.5-0.5B's shapes (2 KV heads); its 14 q heads do not split 4 ways, so 8 here.
QWEN_2KV = ModelConfig(family="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=8,
                       num_kv_heads=2, head_dim=64, intermediate_size=4864, qkv_bias=True)


def _check_divides(tree_specs, tree_shardings, mesh):
    """Every sharded axis divides by its mesh axis; returns {name: PartitionSpec}."""
    decl = params.flat_names(tree_specs, is_leaf=params.is_param)
    shard = params.flat_names(tree_shardings)
    assert decl.keys() == shard.keys()
    for name, p in decl.items():
        spec = shard[name].spec
        assert isinstance(shard[name], NamedSharding) and len(spec) == len(p.shape), name
        for size, axis in zip(p.shape, spec):
            if axis is not None:
                assert size % mesh.shape[axis] == 0, (name, p.shape, spec)
    return {k: v.spec for k, v in shard.items()}


@pytest.mark.parametrize("scan", [False, True])
def test_gemma4_31b_every_weight_sharded_tp4(scan):
    specs = gemma4.specs(G31)
    if scan:
        specs = laid_out(specs, lambda w: gemma4.to_layout(w, G31, scan=True))
        # The declarations match the stacked weights to_layout builds.
        stacked = jax.eval_shape(lambda w: gemma4.to_layout(w, G31, scan=True),
                                 params.abstract(gemma4.specs(G31)))
        got = {k: p.shape for k, p in params.flat_names(specs, is_leaf=params.is_param).items()}
        assert got == {k: x.shape for k, x in params.flat_names(stacked).items()}
    specs_by_name = _check_divides(specs, param_shardings(G31, specs, TP4), TP4)
    lead = (None,) if scan else ()
    sliding, glob = ("blocks.0.0.", "blocks.0.5.")
    assert specs_by_name["embed"] == P("model", None)
    assert specs_by_name["final_norm"] == P(None)
    for layer in (sliding, glob):  # 16 sliding and 4 global KV heads both split 4 ways
        assert specs_by_name[layer + "q"] == P(*lead, "model", None)
        assert specs_by_name[layer + "k"] == P(*lead, "model", None)
        assert specs_by_name[layer + "o"] == P(*lead, None, "model")
        assert specs_by_name[layer + "down"] == P(*lead, None, "model")
        assert specs_by_name[layer + "q_norm"] == P(*lead, None)
    assert specs_by_name[sliding + "v"] == P(*lead, "model", None)
    assert glob + "v" not in specs_by_name  # k_eq_v


def test_kv_heads_replicate_when_indivisible():
    specs = qwen2.specs(QWEN_2KV)
    by_name = _check_divides(specs, param_shardings(QWEN_2KV, specs, TP4), TP4)
    assert by_name["layers.0.q"] == P("model", None) and by_name["layers.0.q_bias"] == P("model")
    assert by_name["layers.0.k"] == P(None, None) and by_name["layers.0.v_bias"] == P(None)
    assert by_name["layers.0.gate"] == P("model", None)
    cache = jax.eval_shape(lambda: qwen2_cache(QWEN_2KV, 2, 8))
    for layer in cache_shardings(cache, TP4).layers:
        assert layer.k.spec == P(None, None, None, None) and layer.k_scale.spec == P(None, None, None)
    # At tp=2 the same 2 KV heads split.
    by_name = _check_divides(specs, param_shardings(QWEN_2KV, specs, DP2_TP2), DP2_TP2)
    assert by_name["layers.0.k"] == P("model", None)
    for layer in cache_shardings(cache, DP2_TP2).layers:
        assert layer.k.spec == P("data", None, "model", None) and layer.v_scale.spec == P("data", None, "model")


def qwen2_cache(cfg, batch, max_len):
    from rvjax.cache import new_cache
    return new_cache(cfg, batch, max_len, "int8")


def test_indivisible_axes_raise_naming_the_axis():
    real = dataclasses.replace(QWEN_2KV, num_heads=14)  # Qwen2.5-0.5B: 14 q heads at tp=4
    with pytest.raises(ValueError, match="q_heads"):
        param_shardings(real, qwen2.specs(real), TP4)
    odd_vocab = dataclasses.replace(QWEN_2KV, vocab_size=151937)
    with pytest.raises(ValueError, match="vocab"):
        param_shardings(odd_vocab, qwen2.specs(odd_vocab), TP4)
    cache = jax.eval_shape(lambda: qwen2_cache(QWEN_2KV, 3, 8))  # batch 3 over data=2
    with pytest.raises(ValueError, match="batch"):
        cache_shardings(cache, DP2_TP2)


def test_collision_on_one_mesh_axis_raises():
    from rvjax.sharding import partition_spec
    with pytest.raises(ValueError, match="'ffn'"):
        partition_spec(("vocab", "ffn"), (8, 8), {"data": 1, "model": 4})


@pytest.mark.parametrize("split", [False, True])
def test_gemma4_31b_cache_shardings(split):
    cache = jax.eval_shape(lambda: gemma4.new_cache(G31, True, 2, 2048, "int8", split=split, block_k=1024))
    sh = cache_shardings(cache, DP2_TP2)
    for arrays, shards in zip(jax.tree.leaves(cache), jax.tree.leaves(sh)):
        spec = shards.spec
        if arrays.ndim == 5:  # k, v [G, B, S, K, H]
            assert spec == P(None, "data", None, "model", None)
        else:  # scales [G, B, S, K]
            assert spec == P(None, "data", None, "model")
    assert jax.tree.structure(cache) == jax.tree.structure(sh)


def test_tiny_gemma4_runs_on_a_1x1_cpu_mesh():
    """The shardings drive a jitted forward on one real device (all axes of size 1: replicated)."""
    cfg = dataclasses.replace(G31, vocab_size=64, hidden_size=32, num_layers=6, num_heads=4, num_kv_heads=2,
                              head_dim=8, global_head_dim=16, global_kv_heads=1, intermediate_size=48,
                              layer_types=(True,) * 5 + (False,), sliding_window=4)
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    specs = laid_out(gemma4.specs(cfg), lambda w: gemma4.to_layout(w, cfg, scan=True))
    w_sh = param_shardings(cfg, specs, mesh)
    w = jax.device_put(params.init(specs, jax.random.key(0)), w_sh)
    cache = gemma4.new_cache(cfg, True, 1, 8, "int8")
    c_sh = cache_shardings(cache, mesh)

    def step(w, tokens, pos, cache):
        h, cache = gemma4.forward(w, cfg, tokens, pos, cache)
        return jnp.argmax(gemma4.logits(w, cfg, h[:, -1]), -1), cache

    f = jax.jit(step, in_shardings=(w_sh, None, None, c_sh), out_shardings=(None, c_sh), donate_argnums=3)
    tok, cache = f(w, jnp.array([[3]]), jnp.array([0]), jax.device_put(cache, c_sh))
    assert tok.shape == (1,) and np.all((0 <= np.asarray(tok)) & (np.asarray(tok) < 64))
