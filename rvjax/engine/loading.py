"""Resolve a model argument (demo name, `.gguf` path, HF directory) to config, weights and tokenizer."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax

from rvjax.errors import ModelNotFoundError
from rvjax.weights.demo import DEMO_MODELS, resolve_demo

log = logging.getLogger("rvjax")


def _quiet_orbax() -> None:
    # Orbax logs every save/restore step at INFO through absl; keep rvjax's own log readable.
    logging.getLogger("absl").setLevel(logging.WARNING)


def load_model(model: str):
    """(config, device weights, tokenizer or None, info dict) for `model`."""
    from rvjax.tokenizer import load_gguf_tokenizer
    from rvjax.weights.hf_dir import read_hf_dir
    from rvjax.weights.store import load_gguf_cached

    _quiet_orbax()
    t0 = time.perf_counter()
    path = Path(model).expanduser()
    if model in DEMO_MODELS:
        path = resolve_demo(model)
    elif not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} is neither a demo model name ({', '.join(sorted(DEMO_MODELS))}), "
            "nor an existing .gguf file, nor an HF checkpoint directory")
    if path.is_file() and path.suffix == ".gguf":
        cfg, weights, cache_hit = load_gguf_cached(path)
        tokenizer = load_gguf_tokenizer(path, name=model)
        source = "gguf"
    elif path.is_dir() and (path / "config.json").is_file():
        cfg, weights = read_hf_dir(path)
        weights = jax.tree.map(jax.numpy.asarray, weights)
        tokenizer, cache_hit, source = None, False, "hf"
    else:
        raise ModelNotFoundError(f"{path} is not a .gguf file or a directory with config.json")
    info = {"path": str(path), "source": source, "conversion_cache_hit": cache_hit,
            "load_seconds": time.perf_counter() - t0}
    return cfg, weights, tokenizer, info
