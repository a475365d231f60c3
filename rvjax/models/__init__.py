"""Model families. Each module provides `specs(cfg)`, `forward(w, cfg, tokens, start, cache)`,
`logits(w, cfg, h)`, and checkpoint name maps `HF_NAMES` / `GGUF_NAMES`."""

from types import ModuleType

from rvjax.models import gemma3, gemma4, qwen2

FAMILIES: dict[str, ModuleType] = {"qwen2": qwen2, "gemma3": gemma3, "gemma4": gemma4}


def family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]
