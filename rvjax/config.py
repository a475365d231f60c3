"""Frozen model configs, read from HF `config.json` dicts or GGUF metadata.

One `ModelConfig` describes every decoder family rvjax runs; family-specific switches are plain
fields with the family's defaults, so small test configs are made with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rvjax.errors import CheckpointError

FAMILIES = ("qwen2", "gemma3", "gemma4")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 10_000.0
    max_position: int = 32_768
    tie_embeddings: bool = True
    # Qwen2: biases on q/k/v (the classic silent omission: rvLLM §5).
    qkv_bias: bool = False
    # Gemma 3 only.
    rope_local_theta: float = 10_000.0
    sliding_window: int | None = None
    sliding_pattern: int = 0  # every `sliding_pattern`-th layer is global; 0: no sliding layers
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (default head_dim)
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    # Gemma 4. `layer_types` (True = sliding) overrides `sliding_pattern` when given; global layers take
    # their own head dim and KV heads (HF's per_layer_config), and with k_eq_v have no v projection.
    layer_types: tuple[bool, ...] = ()
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    k_eq_v: bool = False
    rope_global_fraction: float = 1.0  # proportional partial RoPE on global layers
    ple_dim: int = 0  # per-layer input embeddings (E2B/E4B); 0: none
    ple_vocab: int = 0
    kv_shared_layers: int = 0  # the last n layers reuse the K/V of the last earlier layer of their type
    double_wide_mlp: bool = False  # twice the FFN width on the KV-shared layers

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {FAMILIES}")
        for i in range(self.num_layers):
            if self.num_heads % self.layer_kv_heads(i):
                raise ValueError(f"num_heads={self.num_heads} is not a multiple of layer {i}'s "
                                 f"{self.layer_kv_heads(i)} kv heads")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        for i in range(self.num_layers - self.kv_shared_layers, self.num_layers):
            self.kv_source(i)  # raises if no earlier layer of that type produces K/V

    def is_sliding(self, layer: int) -> bool:
        """Gemma 3's 5:1 pattern: layers 0-4 slide, layer 5 is global, and so on; Gemma 4 lists them."""
        if self.layer_types:
            return self.layer_types[layer]
        return self.sliding_pattern > 0 and (layer + 1) % self.sliding_pattern != 0

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_local_theta if self.is_sliding(layer) else self.rope_theta

    def layer_head_dim(self, layer: int) -> int:
        return self.global_head_dim if self.global_head_dim and not self.is_sliding(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.global_kv_heads if self.global_kv_heads and not self.is_sliding(layer) else self.num_kv_heads

    def layer_has_v(self, layer: int) -> bool:
        """k_eq_v global layers have only k_proj: V is the raw K projection (Gemma 4)."""
        return not (self.k_eq_v and not self.is_sliding(layer))

    def layer_ffn(self, layer: int) -> int:
        return self.intermediate_size * (2 if self.double_wide_mlp and self.kv_shared(layer) else 1)

    def kv_shared(self, layer: int) -> bool:
        return layer >= self.num_layers - self.kv_shared_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V this layer attends over: itself, or for a shared layer the last non-shared
        layer of the same type (HF's `kv_sharing_modes`)."""
        if not self.kv_shared(layer):
            return layer
        first = self.num_layers - self.kv_shared_layers
        same = [i for i in range(first) if self.is_sliding(i) == self.is_sliding(layer)]
        if not same:
            raise ValueError(f"layer {layer} shares K/V, but no earlier layer of its type produces any")
        return same[-1]

    def layer_inv_freq(self, layer: int) -> np.ndarray:
        """RoPE inverse frequencies [H/2] for rotate-half pairing. Gemma 4's proportional partial RoPE keeps
        the exponent denominator at the full head dim and zeroes the rest, so the rotated dims are the first
        `fraction * H / 2` of each half of the head (HF `_compute_proportional_rope_parameters`)."""
        h = self.layer_head_dim(layer)
        fraction = 1.0 if self.is_sliding(layer) else self.rope_global_fraction
        angles = int(fraction * h // 2)
        inv = 1.0 / (self.layer_rope_theta(layer) ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / h))
        return np.concatenate([inv, np.zeros(h // 2 - angles, np.float32)]).astype(np.float32)

    @property
    def attn_scale(self) -> float:
        if self.family == "gemma4":
            return 1.0  # QK-norm bounds the scores; Gemma 4 has no query_pre_attn_scalar
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF `config.json` dict (Qwen2ForCausalLM, Gemma3ForCausalLM)."""
    try:
        return _from_hf_config(hf)
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required key {e.args[0]!r}") from None


def _from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type == "gemma4":  # Gemma4ForConditionalGeneration: the text model's config is nested
        return _gemma4(hf["text_config"])
    if model_type == "gemma4_text":
        return _gemma4(hf)
    common = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        max_position=hf.get("max_position_embeddings", 32_768),
    )
    rope = hf.get("rope_parameters") or {}
    if model_type == "qwen2":
        theta = hf.get("rope_theta") or rope.get("rope_theta", 1_000_000.0)
        return ModelConfig(family="qwen2", rope_theta=theta, qkv_bias=True,
                           tie_embeddings=hf.get("tie_word_embeddings", False), **common)
    if model_type in ("gemma3_text", "gemma3"):
        full = rope.get("full_attention", {})
        local = rope.get("sliding_attention", {})
        if full.get("rope_type", "default") != "default":
            raise CheckpointError(f"Gemma 3 rope scaling {full.get('rope_type')!r} is not supported yet")
        layer_types = hf.get("layer_types")
        pattern = hf.get("sliding_window_pattern", 6)
        if layer_types:
            expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(len(layer_types))]
            if layer_types != expected:
                raise CheckpointError(f"Gemma 3 layer_types {layer_types} do not follow a 1-in-{pattern} global pattern")
        return ModelConfig(
            family="gemma3",
            rope_theta=full.get("rope_theta") or hf.get("rope_theta", 1_000_000.0),
            rope_local_theta=local.get("rope_theta") or hf.get("rope_local_base_freq", 10_000.0),
            sliding_window=hf.get("sliding_window", 512),
            sliding_pattern=pattern,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            # HF's Gemma 3 reads attn_logit_softcapping into the config but never applies it (Gemma 2 did);
            # the released checkpoints set it to null. Follow the reference: no attention soft-cap.
            attn_logit_softcap=None,
            tie_embeddings=hf.get("tie_word_embeddings", True),
            **common,
        )
    raise CheckpointError(f"unsupported model_type {model_type!r} in config.json; "
                          "supported: qwen2, gemma3_text, gemma4, gemma4_text")


def _gemma4(hf: dict[str, Any]) -> ModelConfig:
    n = hf["num_hidden_layers"]
    for key, ok in (("enable_moe_block", False), ("attention_bias", False), ("tie_word_embeddings", True)):
        if hf.get(key, ok) != ok:
            raise CheckpointError(f"Gemma 4 with {key}={hf[key]} is not supported")
    if hf.get("use_bidirectional_attention") == "all":
        raise CheckpointError("Gemma 4 with use_bidirectional_attention='all' is not a causal LM")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise CheckpointError(f"Gemma 4 hidden_activation {hf['hidden_activation']!r} is not supported")
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"Gemma 4 layer_types {types} are not {n} sliding/full entries")
    sliding = tuple(t == "sliding_attention" for t in types)
    # Global layers' head dim and KV heads: per_layer_config (keys are layer indices as strings, zero-padded
    # when there are ten or more layers), or the older global_head_dim / num_global_key_value_heads keys.
    overrides = {int(k): dict(v) for k, v in (hf.get("per_layer_config") or {}).items()}
    if not overrides and any(not s for s in sliding):
        default = {"head_dim": hf.get("global_head_dim", 512)}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads"):
            default["num_key_value_heads"] = hf["num_global_key_value_heads"]
        overrides = {i: default for i in range(n) if not sliding[i]}
    kinds = {_override_key(v) for v in overrides.values()}
    if any(sliding[i] for i in overrides) or len(kinds) > 1 or any(
            set(v) - {"head_dim", "num_key_value_heads"} for v in overrides.values()):
        raise CheckpointError(f"Gemma 4 per_layer_config {hf.get('per_layer_config')} is not one override "
                              "shared by the full-attention layers")
    glob = next(iter(overrides.values()), {})
    rope = hf.get("rope_parameters") or {}
    local, full = rope.get("sliding_attention", {}), rope.get("full_attention", {})
    if local.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in (
            "default", "proportional"):
        raise CheckpointError(f"Gemma 4 rope_parameters {rope} are not supported")
    ple = hf.get("hidden_size_per_layer_input") or 0
    return ModelConfig(
        family="gemma4",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=n,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        intermediate_size=hf["intermediate_size"],
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        max_position=hf.get("max_position_embeddings", 131_072),
        rope_theta=full.get("rope_theta", 1_000_000.0),
        rope_local_theta=local.get("rope_theta", 10_000.0),
        rope_global_fraction=full.get("partial_rotary_factor", 1.0) if full.get("rope_type") == "proportional"
        else 1.0,
        sliding_window=hf.get("sliding_window", 512),
        layer_types=sliding,
        global_head_dim=glob.get("head_dim"),
        global_kv_heads=glob.get("num_key_value_heads"),
        k_eq_v=bool(hf.get("attention_k_eq_v", False)),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        ple_dim=ple,
        ple_vocab=hf.get("vocab_size_per_layer_input", hf["vocab_size"]) if ple else 0,
        kv_shared_layers=hf.get("num_kv_shared_layers", 0),
        double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)),
    )


def _override_key(d: dict) -> str:
    return repr(sorted(d.items()))


def from_gguf_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """ModelConfig from GGUF key/values (`general.architecture` picks the family)."""
    arch = meta.get("general.architecture")

    def get(key, default=None):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is None:
            raise CheckpointError(f"GGUF metadata lacks {full!r}")
        return default

    vocab = len(meta["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in meta else get("vocab_size")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    common = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        intermediate_size=int(get("feed_forward_length")),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position=int(get("context_length")),
        # llama.cpp writes output.weight only when the head is not tied (HF reads it the same way).
        tie_embeddings="output.weight" not in tensor_names,
    )
    if arch == "qwen2":
        return ModelConfig(family="qwen2", rope_theta=float(get("rope.freq_base")), qkv_bias=True, **common)
    if arch == "gemma3":
        if f"{arch}.rope.scaling.type" in meta:
            raise CheckpointError(f"Gemma 3 rope scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported yet")
        # GGUF carries neither the local RoPE base nor the sliding pattern: Gemma 3 fixes them at 10k and 6,
        # and query_pre_attn_scalar at head_dim for the sizes that ship as GGUF (HF's converter assumes the same).
        return ModelConfig(
            family="gemma3",
            rope_theta=float(get("rope.freq_base")),
            rope_local_theta=10_000.0,
            sliding_window=int(get("attention.sliding_window")),
            sliding_pattern=6,
            query_pre_attn_scalar=float(common["head_dim"]),
            **common,
        )
    raise CheckpointError(f"unsupported GGUF architecture {arch!r}; supported: qwen2, gemma3")
