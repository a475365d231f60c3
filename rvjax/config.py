"""Frozen model configs, read from HF `config.json` dicts or GGUF metadata.

One `ModelConfig` describes every decoder family rvjax runs; family-specific switches are plain
fields with the family's defaults, so small test configs are made with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rvjax.errors import CheckpointError

FAMILIES = ("qwen2", "gemma3")


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

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def is_sliding(self, layer: int) -> bool:
        """Gemma 3's 5:1 pattern: layers 0-4 slide, layer 5 is global, and so on."""
        return self.sliding_pattern > 0 and (layer + 1) % self.sliding_pattern != 0

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_local_theta if self.is_sliding(layer) else self.rope_theta

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**d)


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF `config.json` dict (Qwen2ForCausalLM, Gemma3ForCausalLM)."""
    try:
        return _from_hf_config(hf)
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required key {e.args[0]!r}") from None


def _from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type")
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
    raise CheckpointError(f"unsupported model_type {model_type!r} in config.json; supported: qwen2, gemma3_text")


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
