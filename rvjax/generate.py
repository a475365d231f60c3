"""python -m rvjax.generate --model M (--prompt TEXT | --prompt-ids 1,2,3) [--chat] ...

Flags follow the API names (SamplingParams, LLM). Bad input prints one error line, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys

from rvjax.errors import RvjaxError
from rvjax.weights.demo import DEFAULT_MODEL


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rvjax.generate", description="Generate text with rvjax.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="demo model name, .gguf path or HF directory "
                   f"(default {DEFAULT_MODEL})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default here)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--gemma4-path", default="auto", choices=["auto", "single-scan", "split-cache"],
                   help="KV layout of sliding-window models (Gemma 3/4): split-cache keeps ring buffers for "
                   "sliding layers and int8 KV; auto picks it above 32K context")
    p.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unrolled"],
                   help="Gemma 4 layer loop (auto: unrolled on CPU, scan elsewhere)")
    p.add_argument("--json", action="store_true", help='print {"prompt_ids", "token_ids", "text"} as JSON')
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from rvjax import LLM, SamplingParams

        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos)
        ids = None
        if args.prompt_ids is not None:
            try:
                ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
            except ValueError:
                raise RvjaxError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
            if args.chat:
                raise RvjaxError("--chat needs --prompt text, not --prompt-ids")
        elif not args.prompt:
            raise RvjaxError("--prompt is empty")
        llm = LLM(args.model, max_model_len=args.max_model_len, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  gemma4_path=args.gemma4_path, layer_loop=args.layer_loop)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        elif ids is not None:
            out = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    except RvjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = out.outputs[0]
    if args.json:
        print(json.dumps({"prompt_ids": out.prompt_token_ids, "token_ids": c.token_ids, "text": c.text},
                         ensure_ascii=False))
    else:
        print(c.text if c.text is not None else " ".join(map(str, c.token_ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
