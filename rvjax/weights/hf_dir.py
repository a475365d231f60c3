"""HF safetensors directories: `config.json` plus `model.safetensors` or a sharded index."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rvjax.config import from_hf_config
from rvjax.errors import CheckpointError, ModelNotFoundError
from rvjax.models import family
from rvjax.weights.checkpoint import expand_names, map_tensors


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard {missing[0]!r}, which is not in {directory}")
        return [directory / s for s in shards]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelNotFoundError(f"{directory} has config.json but no model.safetensors or model.safetensors.index.json")


def _text_model_only(mod, handles: dict, shapes: dict):
    """A multimodal checkpoint (Gemma4ForConditionalGeneration) keeps the text model under
    `model.language_model.*`: read it as `model.*`, and set the vision and audio towers aside (not in
    scope). Any other tensor still goes through the strict name check."""
    prefix = getattr(mod, "HF_MULTIMODAL_TEXT_PREFIX", None)
    if prefix is None or not any(n.startswith(prefix) for n in shapes):
        return handles, shapes
    others = getattr(mod, "HF_MULTIMODAL_OTHER_PREFIXES", ())
    new_handles, new_shapes = {}, {}
    for name, shape in shapes.items():
        if any(name.startswith(o) for o in others):
            continue
        key = "model." + name[len(prefix):] if name.startswith(prefix) else name
        new_handles[key] = _Renamed(handles[name], name)
        new_shapes[key] = shape
    return new_handles, new_shapes


class _Renamed:
    """A safetensors handle read under another tensor name."""

    def __init__(self, handle, name: str):
        self.handle, self.name = handle, name

    def get_tensor(self, _name: str):
        return self.handle.get_tensor(self.name)


def read_hf_dir(directory: str | Path):
    """(config, weights tree of float32 numpy arrays) from an HF checkpoint directory."""
    from safetensors import safe_open

    directory = Path(directory)
    hf_cfg = json.loads((directory / "config.json").read_text())
    cfg = from_hf_config(hf_cfg)
    handles = {}
    shapes = {}
    for f in safetensors_files(directory):
        h = safe_open(str(f), framework="numpy")
        for name in h.keys():
            if name in handles:
                raise CheckpointError(f"tensor {name!r} appears in two shards")
            handles[name] = h
            shapes[name] = tuple(h.get_slice(name).get_shape())
    mod = family(cfg.family)
    handles, shapes = _text_model_only(mod, handles, shapes)
    if cfg.tie_embeddings and "lm_head.weight" in shapes and "model.embed_tokens.weight" not in shapes:
        raise CheckpointError("checkpoint is missing tensor 'model.embed_tokens.weight' (the config ties "
                              "word embeddings, and only 'lm_head.weight' is present)")
    if cfg.tie_embeddings and "lm_head.weight" in shapes:
        # Some exports write the tied head out too; it must equal the embedding to be dropped safely.
        if not np.array_equal(handles["lm_head.weight"].get_tensor("lm_head.weight"),
                              handles["model.embed_tokens.weight"].get_tensor("model.embed_tokens.weight")):
            raise CheckpointError("config ties word embeddings but 'lm_head.weight' differs from the embedding")
        del shapes["lm_head.weight"]
    names = expand_names(mod.HF_NAMES, cfg.num_layers)
    weights = map_tensors(cfg, names, shapes, lambda n: handles[n].get_tensor(n),
                          norm_offset=mod.HF_NORM_OFFSET, desc=f"loading {directory.name}")
    return cfg, weights
