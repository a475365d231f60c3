"""Gemma 4 31B decode steps compiled ahead of time for a TPU v6e-4 (v6e:2x2, mesh 1 x 4, TP=4), no TPU needed.

    JAX_PLATFORMS=cpu .venv-tpu/bin/python bench/gemma4_tpu_aot.py                 # a, c, b296, scanned + unrolled
    JAX_PLATFORMS=cpu .venv-tpu/bin/python bench/gemma4_tpu_aot.py --no-unrolled \
        b256 b272 b288 b304 b320 b768 b768bf16                                      # the batch search (merged)
    JAX_PLATFORMS=cpu .venv-tpu/bin/python bench/gemma4_tpu_aot.py --table         # table + markdown from the json

Cases: a (single-scan, B=1, 512 ctx, bf16 KV), c (split-cache, B=1, 128K, int8 KV), b<B> (single-scan, 512 ctx,
int8 KV), b<B>bf16 (the same with bf16 KV). The batch candidates follow an arithmetic estimate: 15.35 GB of
weights per chip leave about 16.6 GB, 58.5 MB of int8 KV per sequence per chip at 512 positions.

A case compiles `step(weights, tokens [B, 1], pos [B], cache) -> (argmax token [B], cache)` with full-size bf16
weights, explicit in/out shardings from rvjax/sharding and the cache donated, in the scanned layout (the one
that would run) and, for the step's flops and bytes, in the unrolled layout (cost_analysis counts a scan body
once). Every figure is per chip and a compile-time estimate, not a TPU measurement.

Roofline columns (918 TFLOP/s bf16, 1.6 TB/s HBM, max of the two; ICI collectives not counted):
- analytic: bytes = the step's argument bytes from memory_analysis (all weights + the whole KV cache, each
  read once per step at the last position of the context); flops = 2 B x (matmul weights per chip, the tied
  head included) + attention 4 B (N/tp) H S over the S keys each layer computes scores for: the cache as it
  was before the step (dense: every slot, masked; blockwise: every block holding an earlier position) plus
  the step's own key.
- unrolled: flops and bytes accessed from cost_analysis of the unrolled-layout compile (bytes accessed
  overcounts: every fusion operand counts, VMEM reuse not modelled). The split-cache global layers' blockwise
  attention is a fori_loop with a traced trip count, which cost_analysis counts once, so its unrolled flops
  hold one BLOCK_K block of global attention per layer rather than 16.
"""

from __future__ import annotations

import argparse
import json
from importlib import metadata
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tpu_aot import HBM_BYTES_PER_CHIP, report_of, roofline_ms, v6e_mesh  # first: sets libtpu's env

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from rvjax.cache import kv as kvcache
from rvjax.models import gemma4, params
from rvjax.sharding import cache_shardings, laid_out, param_shardings, partition_spec

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
    except jax.errors.JaxRuntimeError as e:  # an HBM overflow is a compile error on TPU
        msg = str(e).strip()
        return dict(c, name=name, scan=scan, lower_s=t1 - t0, compile_s=time.perf_counter() - t1, compiles=False,
                    fits_32e9=False, error=msg[:2000])
    t2 = time.perf_counter()
    rep = report_of(compiled)
    hlo = compiled.as_text()
    groups = 10 if scan else 1
    trips = (groups, math.ceil(c["ctx"] / BLOCK_K) if c["split"] else 1)
    if not scan:
        trips = trips[1:]
    rep.update(c, name=name, scan=scan, lower_s=t1 - t0, compile_s=t2 - t1,
               compiles=True, fits_32e9=rep["total_bytes"] <= HBM_BYTES_PER_CHIP, collectives=collectives(hlo),
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
        # The step at position ctx - 1 attends over the cache before the step plus its own K/V (+1).
        if not c["split"]:
            keys = ctx + 1  # dense attention scores every slot of the cache, masked
        elif cfg.is_sliding(i):
            keys = min(cfg.layer_window(i), ctx) + 1  # the ring
        else:
            keys = math.ceil((ctx - 1) / BLOCK_K) * BLOCK_K + 1  # every block holding an earlier position
        attn += 4 * b * (n // tp) * h * keys  # q.k and p.v
    flops = 2 * b * weights + attn
    return dict(flops=flops, matmul_flops=2 * b * weights, attention_flops=attn, bytes=argument_bytes,
                roofline_ms=1e3 * max(flops / (TFLOPS * 1e12), argument_bytes / (HBM_TB_S * 1e12)))


def run(names: list[str], unrolled: bool) -> dict:
    cfg = gemma4.variant("gemma-4-31b")
    mesh = v6e_mesh("v6e:2x2", tp=4)
    tp = mesh.shape["model"]
    results = json.loads(JSON_OUT.read_text()) if JSON_OUT.exists() else {}
    results["_machine"] = (f"CPU-only host (2 cores, no TPU); AOT compile for TPU v6e:2x2 "
                           f"({mesh.devices.flat[0].device_kind}) with libtpu {metadata.version('libtpu')}, "
                           f"jax {jax.__version__}; mesh {dict(mesh.shape)}")
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


def ordered(results: dict) -> list[str]:
    return sorted((k for k in results if not k.startswith("_")),
                  key=lambda k: (case(k)["split"], case(k)["batch"], case(k)["kv"]))


def table(results: dict) -> str:
    """One row per case; memory per chip from the scanned compile, roofline columns as the docstring says."""
    rows = [("| path | B | ctx | KV | compiles (libtpu HBM limit 31.25 GiB) | args GB | out GB | temps GB | alias GB "
             "| total GB | compile s scan / unrolled | roofline ms, analytic | + relayout copies ms | roofline ms, "
             "unrolled cost_analysis | tok/s at analytic roofline | rvLLM measured ms/step (tok/s) |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ordered(results):
        e, c = results[name], case(name)
        s, u, a = e.get("scan", {}), e.get("unrolled"), e.get("analytic")
        label = "split-cache" if c["split"] else "single-scan"
        paper = PAPER.get(name) or (PAPER["b768"] if c["batch"] == 768 else None)
        paper_s = f"{paper[0]} ({paper[1]:,})" if paper else ""
        kv = "int8" if c["kv"] == "int8" else "bf16"
        head = f"| {label} | {c['batch']} | {c['ctx']} | {kv} |"
        if "error" in s:
            need = re.search(r"required for HLO temporaries \(([\d.]+G)\)", s["error"])
            why = f"needs {need[1]}iB" if need else s["error"].splitlines()[0][:100].replace("|", "/")
            rows.append(f"{head} no: {why} | | | | | | {s['compile_s']:.0f} / - | | | | | {paper_s} |")
            continue
        u_ok = u is not None and "error" not in u
        u_compile = f"{u['compile_s']:.0f}" if u_ok else "-"
        u_ms = f"{u['roofline_cost_ms']:.2f}" if u_ok else "-"
        copies_ms = 1e3 * s["copy_bytes"]["total"] / (HBM_TB_S * 1e12)
        rows.append(f"{head} yes | {gb(s['argument_bytes'])} | {gb(s['output_bytes'])} | {gb(s['temp_bytes'])} | "
                    f"{gb(s['alias_bytes'])} | {gb(s['total_bytes'])} | {s['compile_s']:.0f} / {u_compile} | "
                    f"{a['roofline_ms']:.2f} | {a['roofline_ms'] + copies_ms:.2f} | {u_ms} | "
                    f"{c['batch'] / a['roofline_ms'] * 1e3:,.0f} | {paper_s} |")
    return "\n".join(rows)


def details(results: dict) -> str:
    """Per-case raw figures behind the roofline columns."""
    rows = [("| case | analytic GFLOP (matmul + attention) | analytic GB read | unrolled cost_analysis GFLOP / GB "
             "accessed | relayout copy GB per step, scan HLO (outside / inside the layer loop) | collectives in "
             "scanned HLO (body counted once) |"),
            "|---|---|---|---|---|---|"]
    for name in ordered(results):
        s, u, a = (results[name].get(k) for k in ("scan", "unrolled", "analytic"))
        if not a:
            continue
        u_s = f"{u['flops'] / 1e9:,.0f} / {u['bytes_accessed'] / 1e9:,.1f}" if u and "error" not in u else "-"
        coll = "; ".join(f"{op}: " + ", ".join(f"{n}x {shape}" for shape, n in shapes.items())
                         for op, shapes in s["collectives"].items())
        rows.append(f"| {name} | {a['flops'] / 1e9:,.0f} ({a['matmul_flops'] / 1e9:,.0f} + "
                    f"{a['attention_flops'] / 1e9:,.0f}) | {a['bytes'] / 1e9:.2f} | {u_s} | "
                    f"{s['copy_bytes']['total'] / 1e9:.2f} ({s['copy_bytes']['entry'] / 1e9:.2f} / "
                    f"{s['copy_bytes']['in_loops'] / 1e9:.2f}) | {coll} |")
    return "\n".join(rows)


def write_markdown(results: dict, table_md: str):
    cfg = gemma4.variant("gemma-4-31b")
    per_tok = {dt: kvcache.kv_bytes_per_token(cfg, dt) for dt in ("bfloat16", "int8")}
    split = kvcache.cache_bytes(cfg, 1, CTX_LONG, "int8", split=True)
    tokens_768 = 768 * CTX_SHORT
    weights_chip = results["a"]["scan"]["argument_bytes"] - kvcache.cache_bytes(cfg, 1, CTX_SHORT, "bfloat16")[
        "sliding"] // 4 - kvcache.cache_bytes(cfg, 1, CTX_SHORT, "bfloat16")["global"] // 4
    room = 31.25 * 2**30 - weights_chip
    k_only = sum(cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) for i in range(cfg.num_layers))  # int8 K, no V
    k_only_global = 10 * CTX_LONG * cfg.global_kv_heads * cfg.global_head_dim // 4
    k_only_ring = 50 * cfg.sliding_window * cfg.num_kv_heads * cfg.head_dim // 4

    def total(name):  # total bytes of a compiled case, or libtpu's "needs" figure in bytes for a rejected one
        r = results.get(name, {}).get("scan", {})
        if "error" in r:
            m = re.search(r"temporaries \(([\d.]+)G\)", r["error"])
            return float(m[1]) * 2**30 if m else float("nan")
        return r.get("total_bytes", float("nan"))

    def copies(name):
        return results[name]["scan"]["copy_bytes"]["total"]

    def unrolled_copies(name):
        return results[name]["unrolled"]["copy_bytes"]["total"]

    def global_buf(name):  # one stacked global K (or V) int8 buffer per chip: [10, B, S, K/tp, H]
        c = case(name)
        return 10 * c["batch"] * c["ctx"] * (cfg.global_kv_heads // 4) * cfg.global_head_dim

    def flop_ms(name):
        return results[name]["analytic"]["flops"] / (TFLOPS * 1e9)

    fitting = [k for k in ordered(results) if not case(k)["split"] and case(k)["kv"] == "int8"
               and results[k]["scan"].get("compiles")]
    rejected = [k for k in ordered(results) if not case(k)["split"] and case(k)["kv"] == "int8"
                and not results[k]["scan"].get("compiles")]
    strict = [k for k in fitting if results[k]["scan"]["fits_32e9"]]
    big = max(fitting, key=lambda k: case(k)["batch"])
    compiled = [k for k in ordered(results) if "analytic" in results[k] and results[k]["scan"].get("compiles")]
    flop_max = max(compiled, key=flop_ms)
    a_over = results["a"]["unrolled"]["bytes_accessed"] / results["a"]["scan"]["argument_bytes"]
    big_flops = results[big]["unrolled"]["flops"] / results[big]["analytic"]["flops"] - 1
    tried = ", ".join(str(case(k)["batch"]) for k in fitting + rejected)
    text = f"""# Gemma 4 31B decode step on TPU v6e-4: AOT compile estimates

Machine: {results['_machine']}. Every number below comes from compiling for that topology
(`bench/gemma4_tpu_aot.py`, helpers in `bench/tpu_aot.py`); nothing ran on a TPU.
**These are compile-time estimates, not measurements on a TPU.** The rvLLM column is the paper's measurement
(§8.3, TPU v6e-4).

Step: `step(weights, tokens[B, 1], pos[B], cache) -> (argmax token [B], cache)`, full-size bf16 weights stacked
for the scanned layer loop (10 groups of 5 sliding + 1 global), TP=4 over mesh ("data", "model") = (1, 4) with
shardings from `rvjax/sharding/rules.py`, cache donated. Memory is per chip, from `memory_analysis()` of the
scanned compile (total = args + out + temps + code - alias). GB = 1e9 bytes.

{table_md}

Roofline columns (918 TFLOP/s, 1.6 TB/s; per chip, which is the step time of the mesh; ICI collectives not
counted):
- **analytic**: bytes = argument bytes (all weights + the whole KV cache, each read once per step at the last
  position of the context); flops = 2 B x matmul weights per chip (tied head included) + attention
  4 B (N/4) H S, S = the keys a layer scores (the cache before the step plus the step's own key). Every case
  is memory-bound: the flop term is at most {flop_ms(flop_max):.1f} ms (B={case(flop_max)['batch']}).
- **+ relayout copies**: the analytic time plus the HBM traffic of the layout copies (>= 1 MB) the TPU
  compiler inserted into the scanned program (below), read + written, times the loop trip counts.
- **unrolled cost_analysis**: `cost_analysis()` of the same step compiled with the unrolled layout
  (`gemma4.to_layout(w, cfg, scan=False)`), as the scanned compile counts the scan body once. Its bytes
  accessed overcount ({a_over:.1f}x the argument bytes at B=1) and include the unrolled program's own relayout
  copies (below), and at B=1 the TPU cost model also counts a [1, D] x [D, F] product as 2.5x its flops
  (checked on a lone matmul; exact from B=8 up). At B={case(big)['batch']} its flops are
  {100 * abs(big_flops):.1f}% {'above' if big_flops > 0 else 'below'} the analytic count. For the split-cache path its blockwise fori_loop (traced trip
  count) is counted once, so it holds one 8192-key block of global attention per layer instead of 16.

{details(results)}

Collectives: per layer two all-reduces of the [B, 5376] activations (after the o and down projections), plus
one after the vocab-sharded embedding lookup and a 4-way all-gather of the per-shard argmax; no weight or KV
all-gathers, so the logical-axis shardings propagate through the model without resharding. At B=1 these 120
small all-reduces are latency-bound and not in the roofline.

## What fits

- Weights: {weights_chip / 1e9:.2f} GB per chip (30.7 B parameters, bf16, TP=4; norms replicated).
- KV per token (all 60 layers, contiguous single-scan cache): bf16 {per_tok['bfloat16']:,} B, int8 with float32
  per-(position, head) scales {per_tok['int8']:,} B. Sliding layers are 91% of it.
- libtpu rejects a program above 31.25 GiB per chip (its own limit; `RESOURCE_EXHAUSTED` at compile time).
  Single-scan 512 ctx int8, batches tried: {tried}. The largest that compiles is B={case(big)['batch']}
  ({total(big) / 1e9:.2f} GB = {total(big) / 2**30:.2f} GiB); rejected: {', '.join(f"B={case(k)['batch']} (needs {total(k) / 2**30:.2f} GiB)" for k in rejected)}.
  Under a strict 32e9-byte reading of "32 GB" the largest is B={max(case(k)['batch'] for k in strict)}
  ({total(max(strict, key=lambda k: case(k)['batch'])) / 1e9:.2f} GB).
- B=768 at 512 context does not fit with either KV format: libtpu needs {total('b768') / 2**30:.2f} GiB per chip
  with int8 KV and {total('b768bf16') / 2**30:.2f} GiB with bf16. Arithmetic check: 768 x 512 tokens x
  {per_tok['bfloat16']:,} B / 4 chips = {tokens_768 * per_tok['bfloat16'] / 4 / 1e9:.1f} GB of bf16 KV per chip (the
  ~88 GB of the brief, confirmed with our own bytes/token), {tokens_768 * per_tok['int8'] / 4 / 1e9:.1f} GB int8, on
  top of {weights_chip / 1e9:.2f} GB of weights.
- Split-cache 128K, B=1, int8: {total('c') / 1e9:.2f} GB per chip; the KV is {(split['sliding'] + split['global']) / 4 / 1e9:.2f} GB
  per chip (rings {split['sliding'] / 4 / 1e6:.0f} MB, global {split['global'] / 4 / 1e9:.2f} GB).

## What the paper's B=768 implies

To hold 768 x 512 tokens next to {weights_chip / 1e9:.2f} GB of bf16 weights, a chip has at most
{room / 1e9:.1f} GB under libtpu's limit: {room / tokens_768 / 1e3:.0f} KB per token per chip, i.e.
{4 * room / tokens_768 / 1e3:.0f} KB per token for the whole model. That is
{per_tok['bfloat16'] / (4 * room / tokens_768):.1f}x less than bf16 K and V for all 60 layers
({per_tok['bfloat16']:,} B) and {per_tok['int8'] / (4 * room / tokens_768):.1f}x less than our int8 cache. With bf16
KV, as §8.3 labels the run, 768 x 512 needs {tokens_768 * per_tok['bfloat16'] / 4 / 1e9:.1f} GB of KV per chip, and
reading it and the weights once would take
{(tokens_768 * per_tok['bfloat16'] / 4 + weights_chip) / 1.6e9:.0f} ms per step at 1.6 TB/s, more than the 55.1 ms
measured (the KV alone: {tokens_768 * per_tok['bfloat16'] / 4 / 1.6e9:.0f} ms). So the paper's B=768 run did not hold bf16 K and V for 512 positions of every
layer of every sequence.

The paper's own accounting is different: §8.5 gives 7.75 GB of weights per chip ("bf16", but that is one byte
per parameter: 30.7 B / 4 chips = 7.67 GB) and "23.5 GB per chip free ... enabling batch sizes up to 768".
768 x 512 tokens fit in 23.5 GB only at <= {4 * 23.5e9 / tokens_768 / 1e3:.0f} KB per token, e.g. int8 K without V
({k_only:,} B/token -> {k_only * tokens_768 / 4 / 1e9:.1f} GB per chip). Its other §8.5 figures, global KV 625 MB
and sliding KV 50 MB per chip at 128K, also match one byte per element of K alone ({k_only_global / 2**20:.0f} MiB
and {k_only_ring / 1e6:.0f} MB), against our {split['global'] / 4 / 1e9:.2f} GB and {split['sliding'] / 4 / 1e6:.0f} MB
for int8 K and V with scales. The paper also calls the comparison "int8 KV vs bf16" in its vLLM-TPU paragraph.
Taken together, the B=768 figure fits the paper's memory model only with one byte per weight and a quarter of
the bytes per token of a bf16 K+V cache; next to bf16 weights it would need <= {4 * room / tokens_768 / 1e3:.0f} KB
per token, less than even int8 K alone.

## Layout copies in the scanned program

The scanned loop only reads the stacked caches: each layer attends over its cache as it was before the step
plus the step's own K/V, every group's new K/V leaves the scan as an output [10, B, 1, ...], and after the loop
one scatter per buffer writes all ten groups. There are no KV-sized copies inside the loop any more
(relayout copies counted as in the table: read + written, copies of at least 1 MB):
- single-scan bf16 B=1: none ({copies('a') / 1e9:.2f} GB per step).
- split-cache 128K: {results['c']['scan']['copy_bytes']['in_loops'] / 1e9:.2f} GB inside the loop;
  {results['c']['scan']['copy_bytes']['entry'] / 1e9:.2f} GB per step outside it (+{copies('c') / 1.6e9:.1f} ms
  over a {results['c']['analytic']['roofline_ms']:.1f} ms roofline): for the one post-loop scatter, the global
  layers' int8 K and V buffers ({global_buf('c') / 1e6:.0f} MB each per chip, all ten groups) are copied from the
  cache's T(32,128) tiling to T(8,128) and back, once per step (plus their float32 scales, 5 MB each).
  Temps {results['c']['scan']['temp_bytes'] / 1e9:.2f} GB.
- single-scan int8 B={case(big)['batch']}: the same post-loop relayout of the global int8 K and V
  ({global_buf(big) / 1e6:.0f} MB each per chip; one KV head per chip, so the sequence axis is the second-minor,
  int8-tiled dimension), {results[big]['scan']['copy_bytes']['entry'] / 1e9:.2f} GB per step outside the loop
  (with ten 3 MB copies of the staged sliding K/V), and
  {results[big]['scan']['copy_bytes']['in_loops'] / 1e9:.2f} GB per step of activation-sized copies inside it
  (1-5 MB attention scores and converted K/V, several of them into memory space S(1), on-chip VMEM, so this
  overstates their HBM traffic): +{copies(big) / 1.6e9:.1f} ms over a
  {results[big]['analytic']['roofline_ms']:.1f} ms roofline. Temps {results[big]['scan']['temp_bytes'] / 1e9:.2f} GB,
  about one relaid-out global buffer; the sliding layers (4 KV heads per chip) are not copied.

An earlier version scattered into the stacked cache inside the scan, and the compiler copied whole KV
buffers every iteration (+18 ms over the roofline at 128K with 0.81 GB of temps, +39 ms at B=296); writing
after the loop removed that. The unrolled layout (compiled here only for cost_analysis) writes each layer's
whole-context cache before reading it, and copies {unrolled_copies('c') / 1e9:.2f} GB per step at 128K and
{unrolled_copies(big) / 1e9:.2f} GB at B={case(big)['batch']} (an intermediate version that read before writing
there copied 8.05 GB at 128K, as XLA kept the old buffer alive next to the in-place update). The copies
left in the scanned program are correct, only slower than needed; a write whose layout matches the cache's
int8 tiling (e.g. K/V packed 4 to an int32, or a dynamic_update_slice per token at B=1) could remove them.
"""
    MD_OUT.write_text(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["a", "c", "b296"])
    ap.add_argument("--no-unrolled", action="store_true", help="skip the unrolled-layout cost compile")
    ap.add_argument("--table", action="store_true", help="only print the table from the json")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    results = json.loads(JSON_OUT.read_text()) if args.table else run(args.cases, not args.no_unrolled)
    md = table(results)
    print(md)
    print(details(results))
    missing = {"a", "c", "b768", "b768bf16"} - set(results)
    if missing or not any(results[k]["scan"].get("fits_32e9") for k in results if k.startswith("b")):
        print(f"{MD_OUT.name} not written: it needs cases {sorted(missing)} and a b<B> case within 32e9 bytes")
    else:
        write_markdown(results, md)
        print(f"wrote {MD_OUT} and {JSON_OUT}")


if __name__ == "__main__":
    main()
