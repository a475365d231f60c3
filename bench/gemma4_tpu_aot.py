"""Gemma 4 31B decode steps compiled ahead of time for a TPU v6e-4 (v6e:2x2, mesh 1 x 4, TP=4), no TPU needed.

    JAX_PLATFORMS=cpu .venv-tpu/bin/python bench/gemma4_tpu_aot.py              # every case, then the table
    JAX_PLATFORMS=cpu .venv-tpu/bin/python bench/gemma4_tpu_aot.py a b256 c     # some cases (merged into the json)
    JAX_PLATFORMS=cpu .venv-tpu/bin/python bench/gemma4_tpu_aot.py --table      # the table from the json only

A case compiles `step(weights, tokens [B, 1], pos [B], cache) -> (argmax token [B], cache)` with full-size bf16
weights, explicit in/out shardings from rvjax/sharding and the cache donated, in the scanned layout (the one
that would run) and, for the step's flops and bytes, in the unrolled layout (cost_analysis counts a scan body
once). Every figure is per chip and a compile-time estimate, not a TPU measurement.

Roofline columns (918 TFLOP/s bf16, 1.6 TB/s HBM, max of the two; ICI collectives not counted):
- analytic: bytes = the step's argument bytes from memory_analysis (all weights + the whole KV cache, each
  read once per step at the last position of the context); flops = 2 B x (matmul weights per chip, the tied
  head included) + attention 4 B (N/tp) H S over the S keys each layer computes scores for.
- unrolled: flops and bytes accessed from cost_analysis of the unrolled-layout compile (bytes accessed
  overcounts: every fusion operand counts, VMEM reuse not modelled). The split-cache global layers' blockwise
  attention is a fori_loop with a traced trip count, which cost_analysis counts once, so its unrolled flops
  hold one BLOCK_K block of global attention per layer rather than 16.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tpu_aot import HBM_BYTES_PER_CHIP, report_of, roofline_ms, v6e_mesh  # noqa: E402  (sets libtpu env first)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from rvjax.cache import kv as kvcache  # noqa: E402
from rvjax.models import gemma4, params  # noqa: E402
from rvjax.sharding import cache_shardings, laid_out, param_shardings, partition_spec  # noqa: E402

RESULTS = Path(__file__).parent / "results"
JSON_OUT = RESULTS / "gemma4_tpu_aot_v6e.json"
MD_OUT = RESULTS / "gemma4_tpu_aot_v6e.md"
TFLOPS, HBM_TB_S = 918.0, 1.6
BLOCK_K = kvcache.DEFAULT_BLOCK_K
CTX_SHORT, CTX_LONG = 512, 131072

# rvLLM paper §8.3 (TPU v6e-4, measured): ms/step and tok/s.
PAPER = {
    "a": (12.79, 78.2, "single-scan, B=1, 512 ctx, bf16 KV"),
    "b768": (55.1, 13943, "single-scan, B=768, 512 ctx, bf16 KV"),
    "c": (40.56, 24.7, "split-cache, B=1, 128K ctx, int8 KV"),
}


def case(name: str) -> dict:
    """a | c | b<B> (int8 KV) | b<B>bf16: the decode step a name stands for."""
    if name == "a":
        return dict(batch=1, ctx=CTX_SHORT, kv="bfloat16", split=False)
    if name == "c":
        return dict(batch=1, ctx=CTX_LONG, kv="int8", split=True)
    m = re.fullmatch(r"b(\d+)(bf16)?", name)
    if not m:
        raise ValueError(f"unknown case {name!r}: a, c, b<B> or b<B>bf16")
    return dict(batch=int(m[1]), ctx=CTX_SHORT, kv="bfloat16" if m[2] else "int8", split=False)


def abstract_weights(cfg, mesh, scan: bool):
    specs = declared = gemma4.specs(cfg)
    if scan:
        specs = laid_out(declared, lambda w: gemma4.to_layout(w, cfg, scan=True))
        # The restacked declarations must be exactly the weights to_layout builds.
        built = jax.eval_shape(lambda w: gemma4.to_layout(w, cfg, scan=True), params.abstract(declared))
        assert (jax.tree.map(lambda x: x.shape, built)
                == jax.tree.map(lambda p: p.shape, specs, is_leaf=params.is_param))
    shardings = param_shardings(cfg, specs, mesh)
    w = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16, sharding=s), specs, shardings,
                     is_leaf=params.is_param)
    return w, shardings


def abstract_cache(cfg, mesh, scan: bool, batch: int, ctx: int, kv: str, split: bool):
    cache = jax.eval_shape(lambda: gemma4.new_cache(cfg, scan, batch, ctx, kv, split=split, block_k=BLOCK_K))
    shardings = cache_shardings(cache, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache, shardings), shardings


def decode_step(cfg, w_sh, c_sh, mesh, batch: int):
    """The jitted step with explicit shardings; the cache is donated (updated in place)."""
    shape = dict(mesh.shape)
    tok_sh = NamedSharding(mesh, partition_spec(("batch", None), (batch, 1), shape))
    pos_sh = NamedSharding(mesh, partition_spec(("batch",), (batch,), shape))

    def step(w, tokens, pos, cache):
        h, cache = gemma4.forward(w, cfg, tokens, pos, cache)  # h [B, 1, D]
        return jnp.argmax(gemma4.logits(w, cfg, h[:, -1]), axis=-1).astype(jnp.int32), cache

    return jax.jit(step, in_shardings=(w_sh, tok_sh, pos_sh, c_sh), out_shardings=(pos_sh, c_sh),
                   donate_argnums=3), tok_sh, pos_sh


COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")


def collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Collective ops in the optimized HLO text by result shape (async pairs counted once, at their -start)."""
    out: dict[str, dict[str, int]] = {}
    for m in COLLECTIVE.finditer(hlo):
        shape = re.sub(r"\{[^}]*\}", "", m[1])  # drop layouts
        out.setdefault(m[2], {})[shape] = out.get(m[2], {}).get(shape, 0) + 1
    return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (?:copy\(|fusion\(.*calls=%copy_fusion)")


def copy_traffic(hlo: str, trips: tuple[int, ...], min_bytes: float = 1e6) -> dict[str, float]:
    """HBM bytes per step moved by relayout copies in the optimized HLO: synchronous copies and copy fusions
    of at least min_bytes, read + written, each times the trip counts of the while loops around it
    (trips[d] for nesting depth d). Async copy-start/done pairs (prefetches into VMEM) are left out."""
    comps: dict[str, list[str]] = {}
    name, entry = None, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            parts = line.split()
            name = parts[1] if parts[0] == "ENTRY" else parts[0]
            entry = name if parts[0] == "ENTRY" else entry
            comps[name] = []
        elif name is not None and line.startswith(" "):
            comps[name].append(line)
    out = {"entry": 0.0, "in_loops": 0.0}

    def walk(comp: str, mult: float, depth: int):
        for line in comps.get(comp, ()):
            m = _COPY.search(line)
            if m and m[1] in _DTYPE_BYTES:
                n = _DTYPE_BYTES[m[1]] * math.prod(int(x) for x in m[2].split(",") if x)
                if n >= min_bytes:
                    out["entry" if depth == 0 else "in_loops"] += 2 * n * mult
            body = re.search(r" while\(.*body=(%[\w.\-]+)", line)
            if body:
                walk(body[1], mult * (trips[depth] if depth < len(trips) else 1), depth + 1)

    walk(entry, 1.0, 0)
    out["total"] = out["entry"] + out["in_loops"]
    return out


def compile_one(cfg, mesh, name: str, scan: bool) -> dict:
    c = case(name)
    w, w_sh = abstract_weights(cfg, mesh, scan)
    cache, c_sh = abstract_cache(cfg, mesh, scan, c["batch"], c["ctx"], c["kv"], c["split"])
    f, tok_sh, pos_sh = decode_step(cfg, w_sh, c_sh, mesh, c["batch"])
    tokens = jax.ShapeDtypeStruct((c["batch"], 1), jnp.int32, sharding=tok_sh)
    pos = jax.ShapeDtypeStruct((c["batch"],), jnp.int32, sharding=pos_sh)
    t0 = time.perf_counter()
    lowered = f.lower(w, tokens, pos, cache)
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # an HBM overflow is a compile error on TPU
        msg = str(e).strip()
        return dict(c, name=name, scan=scan, lower_s=t1 - t0, compile_s=time.perf_counter() - t1, fits=False,
                    error=msg[:2000])
    t2 = time.perf_counter()
    rep = report_of(compiled)
    hlo = compiled.as_text()
    groups = 10 if scan else 1
    trips = (groups, math.ceil(c["ctx"] / BLOCK_K) if c["split"] else 1)
    if not scan:
        trips = trips[1:]
    rep.update(c, name=name, scan=scan, lower_s=t1 - t0, compile_s=t2 - t1,
               fits=rep["total_bytes"] <= HBM_BYTES_PER_CHIP, collectives=collectives(hlo),
               copy_bytes=copy_traffic(hlo, trips),
               roofline_cost_ms=roofline_ms(rep, TFLOPS, HBM_TB_S))
    return rep


def analytic(cfg, name: str, tp: int, argument_bytes: int) -> dict:
    """Per-chip flops and bytes of one decode step at the last position of the context (module docstring)."""
    c = case(name)
    b, ctx, d, n = c["batch"], c["ctx"], cfg.hidden_size, cfg.num_heads
    weights = cfg.vocab_size * d // tp  # the tied output head; the embedding lookup reads B rows only
    attn = 0
    for i in range(cfg.num_layers):
        h, kh, f = cfg.layer_head_dim(i), cfg.layer_kv_heads(i), cfg.layer_ffn(i)
        kv_div = tp if kh % tp == 0 else 1
        weights += (2 * n * h * d + 3 * f * d) // tp + (1 + cfg.layer_has_v(i)) * kh * h * d // kv_div
        if not c["split"]:
            keys = ctx  # dense attention scores every slot of the cache, masked
        elif cfg.is_sliding(i):
            keys = min(cfg.layer_window(i), ctx) + 1  # the ring plus the step's own K/V
        else:
            keys = math.ceil(ctx / BLOCK_K) * BLOCK_K  # every block up to the last position
        attn += 4 * b * (n // tp) * h * keys  # q.k and p.v
    flops = 2 * b * weights + attn
    return dict(flops=flops, matmul_flops=2 * b * weights, attention_flops=attn, bytes=argument_bytes,
                roofline_ms=1e3 * max(flops / (TFLOPS * 1e12), argument_bytes / (HBM_TB_S * 1e12)))


def run(names: list[str], unrolled: bool) -> dict:
    cfg = gemma4.variant("gemma-4-31b")
    mesh = v6e_mesh("v6e:2x2", tp=4)
    tp = mesh.shape["model"]
    results = json.loads(JSON_OUT.read_text()) if JSON_OUT.exists() else {}
    results["_machine"] = (f"CPU-only host, AOT for TPU v6e:2x2 via libtpu; jax {jax.__version__}; "
                           f"mesh {dict(mesh.shape)} on {mesh.devices.flat[0].device_kind}")
    for name in names:
        entry = results.setdefault(name, {})
        for scan in (True, False) if unrolled else (True,):
            key = "scan" if scan else "unrolled"
            print(f"[{name}] {case(name)} {key} ...", flush=True)
            rep = compile_one(cfg, mesh, name, scan)
            entry[key] = rep
            if "error" in rep:
                print(f"  compile failed after {rep['compile_s']:.1f}s: {rep['error'][:600]}", flush=True)
            else:
                print(f"  compiled in {rep['compile_s']:.1f}s (lowered in {rep['lower_s']:.1f}s): total "
                      f"{rep['total_bytes'] / 1e9:.2f} GB/chip (args {rep['argument_bytes'] / 1e9:.2f}, temps "
                      f"{rep['temp_bytes'] / 1e9:.2f}), flops {rep['flops']:.3g}, bytes accessed "
                      f"{rep['bytes_accessed']:.3g}, collectives {rep['collectives']}", flush=True)
                if scan:
                    entry["analytic"] = analytic(cfg, name, tp, rep["argument_bytes"])
            JSON_OUT.write_text(json.dumps(results, indent=1, sort_keys=True))
    return results


def gb(x):
    return f"{x / 1e9:.2f}"


def table(results: dict) -> str:
    rows = ["| case | B | ctx | KV | fits 32 GB | args GB | out GB | temps GB | alias GB | total GB | compile s "
            "(scan / unrolled) | roofline ms: analytic | roofline ms: unrolled cost | analytic tok/s | "
            "rvLLM measured ms/step (tok/s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted((k for k in results if not k.startswith("_")),
                   key=lambda k: (k == "c", case(k)["batch"], case(k)["kv"]))
    for name in order:
        e, c = results[name], case(name)
        s, u, a = e.get("scan", {}), e.get("unrolled"), e.get("analytic")
        label = "split-cache" if c["split"] else "single-scan"
        paper = PAPER.get(name) or (PAPER["b768"] if c["batch"] == 768 else None)
        paper_s = f"{paper[0]} ({paper[1]:,})" if paper else ""
        kv = "int8" if c["kv"] == "int8" else "bf16"
        if "error" in s:
            first = s["error"].splitlines()[0][:120].replace("|", "/")
            rows.append(f"| {label} | {c['batch']} | {c['ctx']} | {kv} | no: compile error `{first}` | | | | | | "
                        f"{s['compile_s']:.0f} | | | | {paper_s} |")
            continue
        u_ms = f"{u['roofline_cost_ms']:.2f}" if u and "error" not in u else "-"
        u_s = f"{u['compile_s']:.0f}" if u and "error" not in u else "-"
        tok_s = f"{c['batch'] / a['roofline_ms'] * 1e3:,.0f}" if a else "-"
        rows.append(f"| {label} | {c['batch']} | {c['ctx']} | {kv} | {'yes' if s['fits'] else 'no'} | "
                    f"{gb(s['argument_bytes'])} | {gb(s['output_bytes'])} | {gb(s['temp_bytes'])} | "
                    f"{gb(s['alias_bytes'])} | {gb(s['total_bytes'])} | {s['compile_s']:.0f} / {u_s} | "
                    f"{a['roofline_ms']:.2f} | {u_ms} | {tok_s} | {paper_s} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["a", "b256", "c"])
    ap.add_argument("--no-unrolled", action="store_true", help="skip the unrolled-layout cost compile")
    ap.add_argument("--table", action="store_true", help="only print the table from the json")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    results = json.loads(JSON_OUT.read_text()) if args.table else run(args.cases, not args.no_unrolled)
    print(table(results))


if __name__ == "__main__":
    main()
