"""Offline API behaviour on the real Gemma 3 270M demo model (the smallest real model we have)."""

from __future__ import annotations

import numpy as np
import pytest

from rvjax import LLM, SamplingParams
from rvjax.errors import InvalidRequestError

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("gemma-3-270m", max_model_len=256)


def test_second_load_comes_from_conversion_cache(llm):
    again = LLM("gemma-3-270m", max_model_len=256)
    assert again.load_info["conversion_cache_hit"]
    ids = llm.tokenize("The quick brown fox")
    a = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    b = again.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_batch_rows_are_independent(llm):
    """A prompt's greedy tokens do not depend on what else is in the (padded) batch."""
    prompts = ["The quick brown fox", "def main():", "Once upon a time, in a land far away, there lived"]
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert alone == together


def test_seed_reproducible_across_batches(llm):
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    a = llm.generate("Tell me a story about", sp, use_tqdm=False)[0].outputs[0].text
    b = llm.generate(["Something else entirely", "Tell me a story about"], sp, use_tqdm=False)[1].outputs[0].text
    assert a == b
    other = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99)
    assert llm.generate("Tell me a story about", other, use_tqdm=False)[0].outputs[0].text != a


def test_stop_string_cuts_text(llm):
    free = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "6" in free.text, free.text
    cut = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0, stop=["6"]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == free.text[: free.text.index("6")]
    assert cut.finish_reason == "stop" and cut.stop_reason == "6"


def test_max_tokens_and_length_finish(llm):
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_ids(llm):
    free = llm.generate("1, 2, 3, 4,", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[3]
    out = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_logprobs_are_top_n_of_the_model(llm):
    ids = llm.tokenize("The capital of France is")
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, temperature=0, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    lg = llm.logits([ids])[0, -1].astype(np.float64)
    lp = lg - (lg.max() + np.log(np.exp(lg - lg.max()).sum()))
    top = np.argsort(-lp)[:3]
    assert set(out.logprobs[0]) == set(top.tolist())
    for t in top:
        assert abs(out.logprobs[0][int(t)] - lp[t]) < 1e-4


def test_kv_dtypes_agree_with_float32(llm):
    """bf16 and int8 KV caches change greedy text little on a short prompt; the first token is the same."""
    ref = llm.generate("The history of the Roman Empire", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for kv in ("bfloat16", "int8"):
        other = LLM("gemma-3-270m", max_model_len=256, kv_cache_dtype=kv)
        got = other.generate("The history of the Roman Empire", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert got[0] == ref[0], kv


@pytest.mark.parametrize("bad, match", [
    (dict(prompts=""), "empty"),
    (dict(prompts=" ".join(str(i) for i in range(300))), "max_model_len"),
    (dict(prompt_token_ids=[[]]), "empty"),
    (dict(prompt_token_ids=[[10**9]]), "outside"),
])
def test_bad_requests_raise_clear_errors(llm, bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(sampling_params=GREEDY, use_tqdm=False, **bad)


def test_chat_without_template_is_a_clear_error(llm):
    with pytest.raises(InvalidRequestError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
