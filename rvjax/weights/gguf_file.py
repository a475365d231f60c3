"""GGUF checkpoints: config from metadata, tensors dequantized to float32 with the `gguf` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rvjax.config import ModelConfig, from_gguf_metadata
from rvjax.errors import CheckpointError
from rvjax.models import family
from rvjax.weights.checkpoint import expand_names, map_tensors

SUPPORTED_QTYPES = {"F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"}


def _scalar_fields(reader) -> dict[str, Any]:
    """Metadata except the big tokenizer arrays (those are the tokenizer's business)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue
        out[key] = field.contents()
    return out


def read_gguf(path: str | Path):
    """(config, weights tree of float32 numpy arrays) from a GGUF file."""
    import gguf
    from gguf import quants

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file: say which
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e
    meta = _scalar_fields(reader)
    if "tokenizer.ggml.tokens" in reader.fields:  # the vocab size, when the file carries a tokenizer
        meta["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"].data))
    tensors = {t.name: t for t in reader.tensors}
    cfg = from_gguf_metadata(meta, set(tensors))
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_QTYPES:
            raise CheckpointError(f"GGUF tensor {t.name!r} has unsupported type {t.tensor_type.name}")
    names = expand_names(family(cfg.family).GGUF_NAMES, cfg.num_layers)
    shapes = {n: tuple(int(s) for s in reversed(t.shape)) for n, t in tensors.items()}

    def load(name: str) -> np.ndarray:
        t = tensors[name]
        return quants.dequantize(t.data, t.tensor_type).reshape(shapes[name])

    # GGUF norms already hold Gemma's `1 + w`: no offset here.
    weights = map_tensors(cfg, names, shapes, load, desc=f"dequantizing {Path(path).name}")
    return cfg, weights


def gguf_config(path: str | Path) -> ModelConfig:
    return read_gguf(path)[0]
