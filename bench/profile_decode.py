"""Where a decode step goes on this CPU: model forward with and without the LM head, against the engine's
per-step time, at batch 1 and 32 (Qwen2.5-0.5B, float32, 128-token prompts). Prints; asserts nothing.

    python bench/profile_decode.py
"""
import time, jax, jax.numpy as jnp
from rvjax import LLM, SamplingParams
from rvjax.cache import new_cache
from rvjax.models import family
llm = LLM("qwen2.5-coder-0.5b-instruct", max_model_len=1024)
cfg, w = llm.model_cfg, llm.weights
mod = family(cfg.family)
def bench(f, *a, n=5):
    r = f(*a); jax.block_until_ready(r)
    t=time.perf_counter()
    for _ in range(n): r = f(*a)
    jax.block_until_ready(r)
    return (time.perf_counter()-t)/n*1e3
for B in [1, 32]:
    cache = new_cache(cfg, B, 256, "float32")
    tok = jnp.zeros((B,1), jnp.int32); start = jnp.full((B,), 100, jnp.int32)
    fwd = jax.jit(lambda w, t, s, c: mod.forward(w, cfg, t, s, c)[0])
    full = jax.jit(lambda w, t, s, c: mod.logits(w, cfg, mod.forward(w, cfg, t, s, c)[0]))
    print(B, "forward(no logits) ms", bench(fwd, w, tok, start, cache), "with logits", bench(full, w, tok, start, cache), flush=True)
    ps = [list(range(1000,1128))]*B
    for mt in [1, 65]:
        sp = SamplingParams(max_tokens=mt, temperature=0, ignore_eos=True)
        llm.generate(prompt_token_ids=ps, sampling_params=sp, use_tqdm=False)
        t=time.perf_counter(); llm.generate(prompt_token_ids=ps, sampling_params=sp, use_tqdm=False); dt=time.perf_counter()-t
        if mt == 1: t1 = dt
        else: print(B, "engine decode ms/step", (dt - t1)/64*1e3, "prefill s", t1, flush=True)
