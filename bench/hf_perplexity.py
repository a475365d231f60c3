"""HF-transformers reference perplexity of the demo GGUF models on rvjax/eval/data/english.txt.

Usage:
    python bench/hf_perplexity.py [--models ...] [--window 512] [--out bench/results/perplexity_hf.json]

Definition (rvjax's evaluator implements exactly the same and must match):
  * ids = tokenizer(text, add_special_tokens=False).input_ids  (the whole file, one call);
  * split ids into consecutive, non-overlapping chunks of W tokens; drop the final partial chunk;
  * if the tokenizer adds BOS by default (Gemma: yes, Qwen: no), each chunk is fed as [BOS] + chunk
    (W + 1 positions) and all W chunk tokens are scored (predicted from BOS .. chunk[W-2]);
    otherwise the chunk alone is fed (W positions) and chunk tokens 1 .. W-1 are scored (W - 1 predictions);
  * every chunk is an independent forward pass from an empty cache;
  * NLL = sum over scored tokens of -log_softmax(logits)[target]; logits come out of the float32 model
    and log_softmax is taken in float64;
  * perplexity = exp(nll_sum / n_predicted).

Note for Gemma 3 (sliding_window = 512): with BOS the sequence has W + 1 = 513 positions, so in the
sliding-window layers the last query does not see position 0 (HF masks kv_idx <= q_idx - sliding_window).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = ("qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
TEXT = ROOT / "rvjax" / "eval" / "data" / "english.txt"


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=path.name, dtype=torch.float32)
    if "gemma" in path.name:
        kwargs["attn_implementation"] = "eager"
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), **kwargs)
    model.eval()
    return tok, model


def adds_bos(tok) -> bool:
    return tok.bos_token_id is not None and tok("a").input_ids[:1] == [tok.bos_token_id]


@torch.inference_mode()
def perplexity(tok, model, text: str, window: int, max_chunks: int | None = None, log=print):
    ids = tok(text, add_special_tokens=False).input_ids
    n_chunks = len(ids) // window
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    bos = adds_bos(tok)
    nll_sum, n_pred = 0.0, 0
    per_chunk = []
    for c in range(n_chunks):
        chunk = ids[c * window : (c + 1) * window]
        if bos:
            inp = [tok.bos_token_id] + chunk
            logits = model(input_ids=torch.tensor([inp]), use_cache=False).logits[0, :-1]  # predicts chunk[0..W-1]
            targets = torch.tensor(chunk)
        else:
            inp = chunk
            logits = model(input_ids=torch.tensor([inp]), use_cache=False).logits[0, :-1]  # predicts chunk[1..W-1]
            targets = torch.tensor(chunk[1:])
        lp = torch.log_softmax(logits.float().double(), dim=-1)
        nll = float(-lp.gather(1, targets[:, None]).sum())
        nll_sum += nll
        n_pred += len(targets)
        per_chunk.append(nll)
        log(f"  chunk {c + 1}/{n_chunks}: nll/tok {nll / len(targets):.4f}  running ppl {math.exp(nll_sum / n_pred):.4f}")
    return dict(
        n_tokens=len(ids),
        n_chunks=n_chunks,
        n_predicted=n_pred,
        bos_prefixed=bos,
        nll_sum=nll_sum,
        perplexity=math.exp(nll_sum / n_pred),
        per_chunk_nll=per_chunk,
    )


def main(argv=None) -> int:
    import transformers
    from rvjax.weights.demo import resolve_demo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-chunks", type=int, default=None, help="debugging only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "perplexity_hf.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = TEXT.read_text(encoding="utf-8")

    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = {r["model"]: r for r in results.get("results", [])} if isinstance(results, dict) else {}
    for name in args.models:
        path = resolve_demo(name)
        print(f"[{name}] loading {path.name} ...", flush=True)
        t0 = time.perf_counter()
        tok, model = load_hf(path)
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        r = perplexity(tok, model, text, args.window, args.max_chunks, log=lambda s: print(s, flush=True))
        eval_s = time.perf_counter() - t1
        results[name] = {
            "model": name,
            "gguf": path.name.split("-", 1)[1],  # drop rvjax's cache-stamp prefix
            "text": "rvjax/eval/data/english.txt",
            "window": args.window,
            "n_tokens": r["n_tokens"],
            "n_chunks": r["n_chunks"],
            "n_predicted": r["n_predicted"],
            "bos_prefixed": r["bos_prefixed"],
            "nll_sum": r["nll_sum"],
            "perplexity": r["perplexity"],
            "per_chunk_nll": r["per_chunk_nll"],
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "dtype": "float32 weights (GGUF dequantized by transformers), float64 log_softmax",
            "load_seconds": round(load_s, 1),
            "wall_seconds": round(eval_s, 1),
            "machine": "2-core CPU, no accelerator",
        }
        print(f"[{name}] ppl {r['perplexity']:.4f} over {r['n_predicted']} tokens; load {load_s:.0f}s, eval {eval_s:.0f}s", flush=True)
        del model
        args.out.parent.mkdir(parents=True, exist_ok=True)
        order = [m for m in DEFAULT_MODELS if m in results] + [m for m in results if m not in DEFAULT_MODELS]
        args.out.write_text(json.dumps({"results": [results[m] for m in order]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
