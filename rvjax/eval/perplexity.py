"""python -m rvjax.eval.perplexity --model M --file text.txt [--window 512]

Definition (bench/hf_perplexity.py computes the same with HF transformers): the text's ids without
special tokens are cut into consecutive windows of W tokens (the last partial window dropped). If the
tokenizer adds BOS, each window is prefixed with BOS and all W tokens are scored; otherwise tokens 1..W-1
are. Perplexity = exp(sum of NLL / number of scored tokens)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from rvjax.errors import RvjaxError

DEFAULT_TEXT = Path(__file__).parent / "data" / "english.txt"


def windows(ids: list[int], window: int, bos: int | None) -> list[list[int]]:
    chunks = [ids[i: i + window] for i in range(0, len(ids) - window + 1, window)]
    return [[bos] + c for c in chunks] if bos is not None else chunks


def nll_of(logits: np.ndarray, seq: list[int]) -> tuple[float, int]:
    """Sum of -log p(seq[t+1] | seq[:t+1]) over a [T, V] logit block, in float64."""
    lg = logits[:-1].astype(np.float64)
    m = lg.max(axis=-1, keepdims=True)
    logz = (m[:, 0] + np.log(np.exp(lg - m).sum(axis=-1)))
    tgt = np.asarray(seq[1:])
    return float((logz - lg[np.arange(len(tgt)), tgt]).sum()), len(tgt)


def perplexity(llm, text: str, window: int = 512, max_windows: int | None = None) -> dict:
    tok = llm.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    seqs = windows(ids, window, tok.bos_id if tok.add_bos else None)[:max_windows]
    if not seqs:
        raise RvjaxError(f"text has {len(ids)} tokens, fewer than one window of {window}")
    total, count = 0.0, 0
    t0 = time.perf_counter()
    for s in seqs:
        nll, n = nll_of(llm.logits([s])[0], s)
        total += nll
        count += n
    return {"window": window, "n_chunks": len(seqs), "n_predicted": count, "nll_sum": total,
            "perplexity": math.exp(total / count), "wall_seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rvjax.eval.perplexity")
    p.add_argument("--model", required=True)
    p.add_argument("--file", default=str(DEFAULT_TEXT))
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--gemma4-path", default="auto", choices=["auto", "single-scan", "split-cache"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        from rvjax import LLM

        path = Path(args.file)
        if not path.is_file():
            raise RvjaxError(f"--file {path} does not exist")
        llm = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, gemma4_path=args.gemma4_path)
        res = perplexity(llm, path.read_text(encoding="utf-8"), args.window, args.max_windows)
    except RvjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = {"model": args.model, "file": os.path.relpath(path), "kv_cache_dtype": llm.kv_dtype, "path": llm.path, **res}
    print(json.dumps(res, indent=1) if args.json else
          f"{args.model}: perplexity {res['perplexity']:.4f} over {res['n_predicted']} tokens "
          f"({res['n_chunks']} windows of {args.window}) in {res['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
