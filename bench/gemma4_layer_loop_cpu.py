"""Gemma 4's layer loop on XLA:CPU: unrolled vs `lax.scan` over groups, for a decode step at B=1 and 8.

    python bench/gemma4_layer_loop_cpu.py   # writes bench/results/gemma4_layer_loop_cpu.md

The model is 31B-shaped at a size this CPU holds (12 layers = 2 groups of 5 sliding + 1 global, hidden
1024, float32 weights, ~0.7 GB), so a decode step is bound by reading the weights. The result decides
`layer_loop="auto"` on CPU."""

from __future__ import annotations

import dataclasses
import os
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

from rvjax.models import gemma4
from rvjax.models.params import init

OUT = Path(__file__).parent / "results" / "gemma4_layer_loop_cpu.md"
STEPS = 10


def config():
    big = gemma4.variant("gemma-4-31b")
    return dataclasses.replace(big, vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_layers=12,
                               num_heads=8, num_kv_heads=4, head_dim=128, global_head_dim=256, global_kv_heads=2,
                               layer_types=big.layer_types[:12])


@partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def step(w, cfg, tok, pos, cache):
    h, cache = gemma4.forward(w, cfg, tok[:, None], pos, cache)
    return jnp.argmax(gemma4.logits(w, cfg, h[:, 0]), axis=-1).astype(jnp.int32), cache


def time_loop(cfg, w, scan: bool, batch: int) -> tuple[float, float]:
    ws = gemma4.to_layout(w, cfg, scan)
    cache = gemma4.new_cache(cfg, ws, batch, 512, "float32")
    tok, pos = jnp.zeros(batch, jnp.int32), jnp.full(batch, 100, jnp.int32)
    t0 = time.perf_counter()
    tok, cache = step(ws, cfg, tok, pos, cache)
    jax.block_until_ready(tok)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(STEPS):
        tok, cache = step(ws, cfg, tok, pos + 1 + i, cache)
    jax.block_until_ready(tok)
    return (time.perf_counter() - t0) / STEPS * 1e3, compile_s


def main() -> None:
    cfg = config()
    w = init(gemma4.specs(cfg), jax.random.key(0), jnp.float32)
    gb = sum(x.nbytes for x in jax.tree.leaves(w)) / 1e9
    lines = ["# Gemma 4 layer loop on XLA:CPU", "",
             f"Machine: this dev box, {len(os.sched_getaffinity(0))} cores, CPU only, jax {jax.__version__}. "
             f"Model: 31B-shaped, 12 layers, hidden 1024, float32 weights {gb:.2f} GB, context 512. "
             f"Decode step = forward + logits + argmax, mean of {STEPS} steps after a warm-up step.", "",
             "| batch | loop | ms/step | first call (compile + run) s |", "|---|---|---|---|"]
    for batch in (1, 8):
        for scan in (False, True):
            ms, comp = time_loop(cfg, w, scan, batch)
            lines.append(f"| {batch} | {'scan (2 groups of 6)' if scan else 'unrolled'} | {ms:.1f} | {comp:.1f} |")
            print(lines[-1], flush=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
