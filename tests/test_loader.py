"""Strict checkpoint loading: HF safetensors directories (single file and sharded), GGUF files, and the
orbax save/restore used by the conversion cache.

Every corrupted checkpoint must raise `CheckpointError` naming the offending tensor; every good one
must load to exactly the arrays that were written, matrices in the layout rvjax declares them
(`as_declared`: [out, in] as checkpoints store them since commit 146d70f, [in, out] before)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from safetensors.numpy import load_file, save_file  # noqa: E402

from rvjax.errors import CheckpointError  # noqa: E402
from rvjax.models import qwen2  # noqa: E402
from rvjax.models.params import flat_names  # noqa: E402
from rvjax.weights.hf_dir import read_hf_dir  # noqa: E402

D, F, V, L, N, K = 32, 64, 64, 2, 4, 2
H = D // N


def make_hf_model(tie: bool = False, seed: int = 0, dtype=None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=D, num_hidden_layers=L, num_attention_heads=N, num_key_value_heads=K,
                      vocab_size=V, intermediate_size=F, max_position_embeddings=256, rope_theta=10_000.0,
                      tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits biases to zero and norms to one: randomise everything
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    if dtype is not None:
        model = model.to(dtype)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model()


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen2_single")
    hf_model.save_pretrained(d, safe_serialization=True)
    assert (d / "model.safetensors").is_file()
    return d


@pytest.fixture(scope="module")
def loaded(hf_dir):
    return read_hf_dir(hf_dir)


def out_in_layout() -> bool:
    """Whether rvjax declares matrices [out, in] as checkpoints store them (else [in, out])."""
    from rvjax.config import ModelConfig

    cfg = ModelConfig(family="qwen2", vocab_size=V, hidden_size=D, num_layers=1, num_heads=N, num_kv_heads=K,
                      head_dim=H, intermediate_size=F, qkv_bias=True)
    gate = qwen2.specs(cfg).layers[0].gate.shape
    assert gate in ((F, D), (D, F)), gate
    return gate == (F, D)


def as_declared(a: np.ndarray) -> np.ndarray:
    """A checkpoint matrix (stored [out, in]) in rvjax's declared layout."""
    return a if out_in_layout() else a.T


def state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def tree_equal(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(np.asarray(x).shape == np.asarray(y).shape and np.array_equal(np.asarray(x), np.asarray(y))
                            for x, y in zip(la, lb))


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy an HF dir, passing its single safetensors file's tensors through `edit(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file(edit(dict(tensors)), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ---- HF directories ---------------------------------------------------------------------------------


def test_hf_dir_loads_exact_weights(hf_model, loaded):
    cfg, w = loaded
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size) == ("qwen2", V, D, L, N, K, H, F)
    assert cfg.qkv_bias and not cfg.tie_embeddings and cfg.rope_theta == 10_000.0
    sd = state_dict(hf_model)
    np.testing.assert_array_equal(w.embed, sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(w.lm_head, sd["lm_head.weight"])
    np.testing.assert_array_equal(w.final_norm, sd["model.norm.weight"])
    for i in range(L):
        p = f"model.layers.{i}."
        lw = w.layers[i]
        np.testing.assert_array_equal(lw.q, as_declared(sd[p + "self_attn.q_proj.weight"]))
        np.testing.assert_array_equal(lw.k, as_declared(sd[p + "self_attn.k_proj.weight"]))
        np.testing.assert_array_equal(lw.v, as_declared(sd[p + "self_attn.v_proj.weight"]))
        np.testing.assert_array_equal(lw.o, as_declared(sd[p + "self_attn.o_proj.weight"]))
        np.testing.assert_array_equal(lw.q_bias, sd[p + "self_attn.q_proj.bias"])
        np.testing.assert_array_equal(lw.v_bias, sd[p + "self_attn.v_proj.bias"])
        np.testing.assert_array_equal(lw.attn_norm, sd[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(lw.mlp_norm, sd[p + "post_attention_layernorm.weight"])
        np.testing.assert_array_equal(lw.gate, as_declared(sd[p + "mlp.gate_proj.weight"]))
        np.testing.assert_array_equal(lw.up, as_declared(sd[p + "mlp.up_proj.weight"]))
        np.testing.assert_array_equal(lw.down, as_declared(sd[p + "mlp.down_proj.weight"]))
    for name, a in flat_names(w).items():
        assert a.dtype == np.float32, name


@pytest.mark.parametrize("case,tensor", [
    ("drop", "model.layers.0.self_attn.q_proj.bias"),
    ("drop", "lm_head.weight"),
    ("drop", "model.norm.weight"),
    ("extra", "model.layers.0.extra.weight"),
    ("extra", "model.layers.2.mlp.up_proj.weight"),  # a layer the config does not have
    ("shape", "model.layers.1.mlp.up_proj.weight"),
    ("shape", "model.layers.0.input_layernorm.weight"),
    ("transpose", "model.layers.1.self_attn.k_proj.weight"),  # [K*H, D] stored as [D, K*H]
])
def test_hf_dir_strictness_names_the_tensor(hf_dir, tmp_path, case, tensor):
    def edit(t):
        if case == "drop":
            del t[tensor]
        elif case == "extra":
            t[tensor] = np.ones((F, D), np.float32)
        elif case == "shape":
            t[tensor] = np.zeros(t[tensor].shape[:-1] + (t[tensor].shape[-1] - 1,), np.float32)
        else:
            t[tensor] = np.ascontiguousarray(t[tensor].T)
        return t

    d = rewrite(hf_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        read_hf_dir(d)
    assert repr(tensor) in str(e.value) or tensor in str(e.value), str(e.value)


def test_sharded_checkpoint_loads_identically(hf_model, loaded, tmp_path):
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "model.safetensors").exists()
    cfg, w = read_hf_dir(tmp_path)
    assert cfg == loaded[0]
    assert tree_equal(w, loaded[1])


def test_sharded_index_naming_a_missing_shard(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        read_hf_dir(tmp_path)


def test_tensor_in_two_shards_is_an_error(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    first = load_file(shards[0])
    name = sorted(first)[0]
    second = load_file(shards[1])
    second[name] = first[name]
    save_file(second, shards[1], metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        read_hf_dir(tmp_path)


def test_tied_checkpoint(tmp_path):
    model = make_hf_model(tie=True, seed=1)
    model.save_pretrained(tmp_path / "tied", safe_serialization=True)
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / "model.safetensors")
    cfg, w = read_hf_dir(tmp_path / "tied")
    assert cfg.tie_embeddings and w.lm_head is None
    np.testing.assert_array_equal(w.embed, state_dict(model)["model.embed_tokens.weight"])

    # Some exports also write the tied head: fine when it equals the embedding ...
    def with_head(t, delta):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + np.float32(delta)
        return t

    cfg2, w2 = read_hf_dir(rewrite(tmp_path / "tied", tmp_path / "head_same", lambda t: with_head(t, 0.0)))
    assert w2.lm_head is None and tree_equal(w2, w)
    # ... an error naming it when it differs.
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        read_hf_dir(rewrite(tmp_path / "tied", tmp_path / "head_diff", lambda t: with_head(t, 0.5)))



def test_tied_checkpoint_with_head_but_no_embedding(tmp_path):
    model = make_hf_model(tie=True, seed=1)
    model.save_pretrained(tmp_path / "tied", safe_serialization=True)

    def swap(t):
        t["lm_head.weight"] = t.pop("model.embed_tokens.weight")
        return t

    with pytest.raises(CheckpointError, match="model.embed_tokens.weight"):
        read_hf_dir(rewrite(tmp_path / "tied", tmp_path / "bad", swap))


def test_bfloat16_checkpoint_loads_as_float32(tmp_path):
    model = make_hf_model(seed=2, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, w = read_hf_dir(tmp_path)
    sd = state_dict(model)  # bf16 upcast to float32: exact
    np.testing.assert_array_equal(w.embed, sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(w.layers[1].gate, as_declared(sd["model.layers.1.mlp.gate_proj.weight"]))
    assert w.layers[1].gate.dtype == np.float32


def test_unsupported_model_type(hf_dir, tmp_path):
    d = shutil.copytree(hf_dir, tmp_path / "llama")
    c = json.loads((d / "config.json").read_text())
    c["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match="llama"):
        read_hf_dir(d)


# ---- GGUF -------------------------------------------------------------------------------------------


def gguf_tensors_from_hf(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same weights under llama.cpp names (both stored [out, in] in numpy order)."""
    from rvjax.weights.checkpoint import expand_names

    hf_to_canon = expand_names(qwen2.HF_NAMES, L)
    canon_to_gguf = {c: g for g, c in expand_names(qwen2.GGUF_NAMES, L).items()}
    return {canon_to_gguf[hf_to_canon[k]]: v for k, v in sd.items()}


def write_gguf(path: Path, tensors: dict[str, np.ndarray], *, tokens: bool = True, vocab_size_key: bool = False):
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10_000.0)
    if vocab_size_key:
        w.add_vocab_size(V)
    if tokens:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"tok{i}" for i in range(V)])
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_tensors(hf_model):
    return gguf_tensors_from_hf(state_dict(hf_model))


def test_gguf_loads_same_weights_as_hf(gguf_tensors, loaded, tmp_path):
    from rvjax.weights.gguf_file import read_gguf

    cfg, w = read_gguf(write_gguf(tmp_path / "m.gguf", gguf_tensors))
    hf_cfg, hf_w = loaded
    for f in ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "rope_theta", "tie_embeddings", "qkv_bias"):
        assert getattr(cfg, f) == getattr(hf_cfg, f), f
    assert cfg.max_position == 256
    assert tree_equal(w, hf_w)


def test_gguf_f16_tensor_is_dequantized(gguf_tensors, tmp_path):
    from rvjax.weights.gguf_file import read_gguf

    t = dict(gguf_tensors)
    t["blk.0.ffn_up.weight"] = t["blk.0.ffn_up.weight"].astype(np.float16)
    _, w = read_gguf(write_gguf(tmp_path / "m.gguf", t))
    np.testing.assert_array_equal(w.layers[0].up, as_declared(t["blk.0.ffn_up.weight"].astype(np.float32)))


@pytest.mark.parametrize("case,tensor", [
    ("drop", "blk.0.attn_q.bias"),
    ("drop", "output_norm.weight"),
    ("extra", "blk.0.extra.weight"),
    ("shape", "blk.1.ffn_up.weight"),
    ("transpose", "blk.1.attn_k.weight"),
])
def test_gguf_strictness_names_the_tensor(gguf_tensors, tmp_path, case, tensor):
    from rvjax.weights.gguf_file import read_gguf

    t = dict(gguf_tensors)
    if case == "drop":
        del t[tensor]
    elif case == "extra":
        t[tensor] = np.ones((F, D), np.float32)
    elif case == "shape":
        t[tensor] = np.zeros((F, D - 1), np.float32)
    else:
        t[tensor] = np.ascontiguousarray(t[tensor].T)
    with pytest.raises(CheckpointError) as e:
        read_gguf(write_gguf(tmp_path / "bad.gguf", t))
    assert tensor in str(e.value), str(e.value)


def test_map_tensors_directly_with_gguf_names(loaded):
    """The strict mapper on its own, with GGUF names, shapes as stored ([out, in]) and a fake loader."""
    from rvjax.weights.checkpoint import expand_names, map_tensors

    cfg = loaded[0]
    names = expand_names(qwen2.GGUF_NAMES, cfg.num_layers)
    declared = flat_names(qwen2.specs(cfg), is_leaf=lambda x: hasattr(x, "axes"))
    canon_to_gguf = {c: g for g, c in names.items()}
    shapes = {}
    for canon, spec in declared.items():
        shp = spec.shape
        as_stored = shp if canon in ("embed", "lm_head") or len(shp) == 1 or out_in_layout() else shp[::-1]
        shapes[canon_to_gguf[canon]] = as_stored
    fill = {n: np.full(s, i, np.float32) for i, (n, s) in enumerate(shapes.items())}
    w = map_tensors(cfg, names, shapes, fill.__getitem__)
    np.testing.assert_array_equal(w.layers[1].gate, as_declared(fill["blk.1.ffn_gate.weight"]))
    np.testing.assert_array_equal(w.lm_head, fill["output.weight"])
    for bad_shapes, name in [
        ({k: v for k, v in shapes.items() if k != "blk.1.attn_v.bias"}, "blk.1.attn_v.bias"),
        ({**shapes, "blk.0.ffn_gate_exps.weight": (2, 2)}, "blk.0.ffn_gate_exps.weight"),
        ({**shapes, "blk.0.ffn_down.weight": (F, D)}, "blk.0.ffn_down.weight"),  # [out, in] expected (D, F)
    ]:
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            map_tensors(cfg, names, bad_shapes, fill.__getitem__)


def test_unreadable_gguf_is_a_checkpoint_error(tmp_path):
    from rvjax.weights.gguf_file import read_gguf

    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 13)
    with pytest.raises(CheckpointError, match="junk.gguf"):
        read_gguf(bad)



def test_gguf_without_tokenizer_vocab(gguf_tensors, tmp_path):
    from rvjax.weights.gguf_file import read_gguf

    path = write_gguf(tmp_path / "notok.gguf", gguf_tensors, tokens=False, vocab_size_key=True)
    try:
        cfg, _ = read_gguf(path)
    except CheckpointError:
        return  # a clear refusal is acceptable too
    assert cfg.vocab_size == V


# ---- orbax ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_orbax_round_trip(loaded, tmp_path, tie):
    from rvjax.weights import store

    if tie:
        model = make_hf_model(tie=True, seed=3)
        model.save_pretrained(tmp_path / "hf", safe_serialization=True)
        cfg, w = read_hf_dir(tmp_path / "hf")
    else:
        cfg, w = loaded
    store.save(tmp_path / "ckpt", cfg, jax.tree.map(jax.numpy.asarray, w))
    cfg2, w2 = store.restore(tmp_path / "ckpt")
    assert cfg2 == cfg
    assert (w2.lm_head is None) == tie
    assert tree_equal(w2, w)
    # save() over an existing directory replaces it
    store.save(tmp_path / "ckpt", cfg, jax.tree.map(lambda a: jax.numpy.asarray(a) * 2, w))
    _, w3 = store.restore(tmp_path / "ckpt")
    np.testing.assert_array_equal(np.asarray(w3.layers[0].q), 2 * np.asarray(w.layers[0].q))
