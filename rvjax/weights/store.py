"""Orbax save/restore of converted weights, and the GGUF conversion cache.

The first load of a GGUF dequantizes it (with a progress bar) and saves the float32 tree with orbax
under `<cache>/converted/`; later loads restore from there in seconds."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import jax

from rvjax.config import ModelConfig
from rvjax.models import family
from rvjax.models.params import abstract
from rvjax.weights.demo import cache_dir

log = logging.getLogger("rvjax")

# Bump when the conversion's output changes meaning, so stale caches are never read (rvLLM §5).
CONVERSION_VERSION = 2


def save(directory: str | Path, cfg: ModelConfig, weights) -> None:
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / "rvjax_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "weights", weights)


def restore(directory: str | Path):
    """(config, weights as device arrays) from a directory written by `save`."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    cfg = ModelConfig.from_dict(json.loads((directory / "rvjax_config.json").read_text()))
    target = abstract(family(cfg.family).specs(cfg))
    with ocp.StandardCheckpointer() as ckptr:
        weights = ckptr.restore(directory / "weights", target)
    return cfg, weights


def conversion_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{CONVERSION_VERSION}".encode())
    return cache_dir() / "converted" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"


def load_gguf_cached(gguf_path: Path):
    """(config, device weights, cache_hit) for a GGUF file, converting it once into the cache."""
    from rvjax.weights.gguf_file import read_gguf

    target = conversion_dir(gguf_path)
    done = target / "COMPLETE"
    if done.is_file():
        cfg, weights = restore(target)
        return cfg, weights, True
    log.info("converting %s once into %s", gguf_path.name, target)
    cfg, weights = read_gguf(gguf_path)
    weights = jax.tree.map(jax.numpy.asarray, weights)
    tmp = target.with_name(target.name + ".tmp")
    save(tmp, cfg, weights)
    (tmp / "COMPLETE").write_text("ok\n")
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return cfg, weights, False
