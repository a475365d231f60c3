"""Offline throughput on this machine: rvjax vs llama.cpp (llama-cpp-python) vs HF transformers.

    python bench/offline.py [--models M ...] [--batches 1 8 32 64] [--hf] [--out bench/results/offline_cpu.md]

For each demo model: prefill tok/s (B prompts of 128 tokens, one generated token), decode tok/s at each
batch size (128-token prompts, 64 generated tokens with EOS ignored; decode time = that run minus the
prefill-only run), and the whole batched job (32 x (128 + 64)). Peers run when installed:
llama-cpp-python (`pip install llama-cpp-python`, one sequence at a time through its high-level API)
and HF transformers (`--hf`, float32; slow to convert). Also prints the float32 batch-1 decode roofline:
weight bytes read per step over the measured bandwidth of a large array copy. Timings are printed and
written to bench/results/; nothing here asserts on time."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

PROMPT_LEN, GEN = 128, 64
ROOT = Path(__file__).resolve().parent


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes moved (read + write) per second by a large numpy copy: the machine's streaming bandwidth."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    text = (ROOT.parent / "rvjax" / "eval" / "data" / "english.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    step = PROMPT_LEN - len(bos)
    return [bos + ids[i * step:(i + 1) * step] for i in range(n)]


def timed(fn, repeats: int = 1) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_rvjax(model: str, batches: list[int]) -> dict:
    import jax

    from rvjax import LLM, SamplingParams

    llm = LLM(model, max_model_len=1024)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.weights))
    # A decode step reads every weight once, except an untied embedding (only B rows are gathered).
    tied = llm.model_cfg.tie_embeddings
    step_bytes = weight_bytes if tied else weight_bytes - llm.weights.embed.nbytes
    res = {"weights_gb": weight_bytes / 1e9, "step_read_gb": step_bytes / 1e9}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gen = SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True)
    for b in sorted(set(batches) | {32}):
        ps = prompts_of(llm.tokenizer, b)
        run = lambda sp: llm.generate(prompt_token_ids=ps, sampling_params=sp, use_tqdm=False)  # noqa: E731
        run(one), run(gen)  # compile every shape first
        reps = 2 if b <= 8 else 1
        t_pre = timed(lambda: run(one), reps)
        t_all = timed(lambda: run(gen), reps)
        res[f"prefill_B{b}"] = b * PROMPT_LEN / t_pre
        res[f"decode_B{b}"] = b * (GEN - 1) / max(t_all - t_pre, 1e-9)
        res[f"job_B{b}_s"] = t_all
        print(f"  rvjax {model} B={b}: prefill {res[f'prefill_B{b}']:.0f} tok/s, decode "
              f"{res[f'decode_B{b}']:.1f} tok/s, job {t_all:.1f} s", flush=True)
    return res


def bench_llama_cpp(model: str, batches: list[int]) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from rvjax.tokenizer import load_gguf_tokenizer
    from rvjax.weights.demo import resolve_demo

    path = resolve_demo(model)
    tok = load_gguf_tokenizer(path)
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=os.cpu_count(), n_batch=512, verbose=False)
    ps = prompts_of(tok, 2)
    res = {}

    def one(p, n):
        llm.reset()
        llm.eval(p)
        for _ in range(n - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])

    one(ps[0], 2)
    t_pre = timed(lambda: one(ps[1], 1), 2)
    t_all = timed(lambda: one(ps[1], GEN), 1)
    res["prefill_B1"] = PROMPT_LEN / t_pre
    res["decode_B1"] = (GEN - 1) / (t_all - t_pre)
    res["job_B32_s"] = 32 * t_all  # one sequence at a time through the high-level API
    print(f"  llama.cpp {model} B=1: prefill {res['prefill_B1']:.0f} tok/s, decode {res['decode_B1']:.1f} tok/s",
          flush=True)
    return res


def bench_hf(model: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rvjax.tokenizer import load_gguf_tokenizer
    from rvjax.weights.demo import resolve_demo

    path = resolve_demo(model)
    torch.set_num_threads(os.cpu_count())
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ps = prompts_of(load_gguf_tokenizer(path), 1)
    x = torch.tensor(ps)
    with torch.no_grad():
        m.generate(x, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        t_pre = timed(lambda: m.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False), 1)
        t_all = timed(lambda: m.generate(x, max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False), 1)
    res = {"prefill_B1": PROMPT_LEN / t_pre, "decode_B1": (GEN - 1) / (t_all - t_pre)}
    print(f"  HF {model} B=1: prefill {res['prefill_B1']:.0f} tok/s, decode {res['decode_B1']:.1f} tok/s", flush=True)
    return res


def table(results: dict, batches: list[int], bw: float) -> str:
    lines = [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, no accelerator; "
             f"large-copy bandwidth {bw:.1f} GB/s. Prompts {PROMPT_LEN} tokens, {GEN} generated, greedy. "
             "llama.cpp runs through llama-cpp-python's single-sequence API, so its B=32 job is 32 sequences "
             "one after another.", ""]
    head = ["model", "engine", "prefill B=1", "prefill B=32"] + [f"decode B={b}" for b in batches]
    head += ["32x(128+64) job s"]
    fmt = lambda r, k, f="{:.1f}": f.format(r[k]) if r and k in r else "–"  # noqa: E731
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, per in results.items():
        for engine, r in per.items():
            if not r or engine == "roofline":
                continue
            cells = [model, engine, fmt(r, "prefill_B1", "{:.0f}"), fmt(r, "prefill_B32", "{:.0f}")]
            cells += [fmt(r, f"decode_B{b}") for b in batches] + [fmt(r, "job_B32_s")]
            lines.append("| " + " | ".join(cells) + " |")
        rv, lc = per.get("rvjax"), per.get("llama.cpp")
        if rv and lc:
            cells = [model, "rvjax / llama.cpp", f"{rv['prefill_B1'] / lc['prefill_B1']:.2f}x", "",
                     f"{rv['decode_B1'] / lc['decode_B1']:.2f}x"] + [""] * (len(batches) - 1)
            cells.append(f"{lc['job_B32_s'] / rv['job_B32_s']:.2f}x faster")
            lines.append("| " + " | ".join(cells) + " |")
        roof = per["roofline"]
        cells = [model, "f32 roofline", "", "", f"{roof['tok_s']:.1f} ({roof['read_gb']:.2f} GB/step): rvjax at "
                 f"{100 * per['rvjax']['decode_B1'] / roof['tok_s']:.0f}%"] + [""] * len(batches)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--hf", action="store_true", help="also time HF transformers (converts the GGUF: minutes)")
    ap.add_argument("--out", default=str(ROOT / "results" / "offline_cpu.md"))
    ap.add_argument("--table-from", help="re-render the table from a results .json instead of measuring")
    ap.add_argument("--add-hf-to", help="time only HF transformers and add it to this results .json")
    args = ap.parse_args()
    if args.table_from or args.add_hf_to:
        path = Path(args.table_from or args.add_hf_to)
        saved = json.loads(path.read_text())
        if args.add_hf_to:
            for model in args.models:
                saved["results"][model]["HF transformers"] = bench_hf(model)
            path.write_text(json.dumps(saved, indent=1))
        print(table(saved["results"], saved["batches"], saved["bandwidth_gbs"]))
        return
    bw = copy_bandwidth_gbs()
    print(f"large-copy bandwidth: {bw:.1f} GB/s", flush=True)
    results = {}
    for model in args.models:
        per = {"rvjax": bench_rvjax(model, args.batches)}
        per["llama.cpp"] = bench_llama_cpp(model, args.batches)
        if args.hf:
            per["HF transformers"] = bench_hf(model)
        read = per["rvjax"]["step_read_gb"]
        per["roofline"] = {"read_gb": read, "tok_s": bw / read}
        results[model] = per
    out = table(results, args.batches, bw)
    print(out)
    Path(args.out).write_text("# Offline throughput (bench/offline.py)\n\n" + out)
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({"results": results, "batches": args.batches, "bandwidth_gbs": bw}, indent=1))


if __name__ == "__main__":
    main()
