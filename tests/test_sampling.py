"""rvjax.sampling against independent NumPy references.

`sample` is called under `jax.jit` with `num_logprobs` static, as the engine calls it. Every shape
used here is fixed per test so each test compiles the sampler once or twice, not per example."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rvjax.errors import InvalidRequestError
from rvjax.sampling import MAX_LOGPROBS, SamplingParams, SamplingTensors, apply_penalties, sample

_sample = jax.jit(sample, static_argnames="num_logprobs")
_penalties = jax.jit(apply_penalties)


# ---- helpers ---------------------------------------------------------------------------------------


def tensors(params, batch=None) -> SamplingTensors:
    return SamplingTensors.from_params(params, batch or len(params), np.random.default_rng(0))


def draw(logits, st_, step, counts=None, prompt_mask=None, num_logprobs=0):
    """One jitted sampler call; `step` is an int (every row) or a [B] array."""
    logits = np.asarray(logits, np.float32)
    b, v = logits.shape
    counts = np.zeros((b, v), np.int32) if counts is None else counts
    prompt_mask = np.zeros((b, v), bool) if prompt_mask is None else prompt_mask
    step = np.full((b,), step, np.int32) if np.isscalar(step) else np.asarray(step, np.int32)
    out = _sample(jnp.asarray(logits), st_, jnp.asarray(counts, jnp.int32), jnp.asarray(prompt_mask),
                  jnp.asarray(step), num_logprobs=num_logprobs)
    return [np.asarray(x) for x in out]


def softmax(x):
    x = np.asarray(x, np.float64)
    m = np.max(x)
    e = np.where(np.isneginf(x), 0.0, np.exp(x - m))
    return e / e.sum()


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def allowed_set(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Boolean [V] of tokens a sampled row may produce, computed in float64 (ties at a cut are kept)."""
    # Scale in float32 as the sampler does, so near-equal logits tie (or not) exactly as they do there.
    x = (np.asarray(logits, np.float32) / np.float32(max(temperature, 1e-6))).astype(np.float64)
    v = x.size
    keep = np.ones(v, bool)
    if top_k > 0:
        kth = np.sort(x)[::-1][min(top_k, v) - 1]
        keep &= x >= kth
    if top_p < 1.0:
        p = softmax(np.where(keep, x, -np.inf))
        order = np.argsort(-x, kind="stable")
        ps = p[order]
        before = np.cumsum(ps) - ps  # mass strictly before each sorted token
        n_kept = int(np.sum(before < top_p))
        keep &= x >= x[order][n_kept - 1]
    p = softmax(np.where(keep, x, -np.inf))
    keep &= p >= min_p * p.max()
    return keep


def filtered_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    keep = allowed_set(logits, temperature, top_k, top_p, min_p)
    x = np.asarray(logits, np.float64) / temperature
    return softmax(np.where(keep, x, -np.inf))


# ---- filters on known logits ----------------------------------------------------------------------

# Well-separated logits, V = 12: probabilities differ enough that every cut below is unambiguous.
KNOWN = np.array([2.0, -1.0, 3.5, 0.5, 1.0, -3.0, 2.8, 0.0, -0.5, 1.7, -2.0, 3.1], np.float32)


def test_reference_allowed_sets_are_what_we_think():
    """Pin the NumPy reference itself on the known logits, so the sampler tests below mean something."""
    order = list(np.argsort(-KNOWN))  # 2, 11, 6, 0, 9, 4, 3, 7, 8, 1, 10, 5
    assert set(np.flatnonzero(allowed_set(KNOWN, 1.0, top_k=3))) == set(order[:3])
    p = softmax(KNOWN)[order]
    n = int(np.sum(np.cumsum(p) - p < 0.6))
    assert 1 < n < 12
    assert set(np.flatnonzero(allowed_set(KNOWN, 1.0, top_p=0.6))) == set(order[:n])
    # min_p 0.2: p >= 0.2 * p_max  <=>  logit >= 3.5 + log(0.2) = 1.89
    assert set(np.flatnonzero(allowed_set(KNOWN, 1.0, min_p=0.2))) == {2, 11, 6, 0}
    assert allowed_set(KNOWN, 1.0).all()


ROW_PARAMS = [
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.7, min_p=0.2),
    dict(temperature=0.0),  # greedy, in the same batch as sampled rows
    dict(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05),
    dict(temperature=1.0),  # no filter at all
]


def test_mixed_batch_stays_in_allowed_sets_and_covers_them():
    """One batch, a different filter per row; over many steps each row samples only its allowed
    tokens and reaches every allowed token that is not very unlikely."""
    rows = len(ROW_PARAMS)
    logits = np.tile(KNOWN, (rows, 1))
    params = [SamplingParams(seed=100 + i, **kw) for i, kw in enumerate(ROW_PARAMS)]
    st_ = tensors(params, batch=8)  # padded rows too, as the engine pads to a power of two
    seen = [set() for _ in range(rows)]
    for step in range(300):
        tok = draw(np.vstack([logits, np.zeros((2, KNOWN.size), np.float32)]), st_, step)[0]
        for i in range(rows):
            seen[i].add(int(tok[i]))
    for i, kw in enumerate(ROW_PARAMS):
        if kw["temperature"] == 0:
            assert seen[i] == {int(np.argmax(KNOWN))}
            continue
        allowed = set(np.flatnonzero(allowed_set(KNOWN, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0),
                                                 kw.get("min_p", 0.0))).tolist())
        assert seen[i] <= allowed, (kw, seen[i] - allowed)
        # Filters must not cut more than asked: every allowed token of non-negligible probability shows up.
        probs = filtered_probs(KNOWN, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
        likely = set(np.flatnonzero(probs > 0.03).tolist())
        assert len(likely) >= 2 and likely <= seen[i], (kw, likely - seen[i])


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(1).normal(size=(4, 40)).astype(np.float32) * 3
    params = [SamplingParams(temperature=1.0, top_k=1, seed=1), SamplingParams(temperature=2.0, top_p=1e-6, seed=2),
              SamplingParams(temperature=1.0, min_p=1.0, seed=3), SamplingParams(temperature=0.0)]
    st_ = tensors(params)
    for step in range(50):
        tok = draw(logits, st_, step)[0]
        np.testing.assert_array_equal(tok, logits.argmax(-1))


def test_top_k_larger_than_vocab_is_no_filter():
    logits = np.zeros((1, 10), np.float32)
    st_ = tensors([SamplingParams(temperature=1.0, top_k=1000, seed=5)])
    seen = {int(draw(logits, st_, s)[0][0]) for s in range(200)}
    assert seen == set(range(10))


B_H, V_H = 4, 32  # fixed shapes: the hypothesis test below compiles the sampler once

row_params = st.fixed_dictionaries(dict(
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.one_of(st.just(0), st.integers(1, V_H + 4)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**32 - 1),
))


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(logits=st.lists(st.lists(st.floats(-8, 8, width=32), min_size=V_H, max_size=V_H), min_size=B_H, max_size=B_H),
       params=st.lists(row_params, min_size=B_H, max_size=B_H), step0=st.integers(0, 2**20))
def test_sampled_tokens_never_leave_allowed_set(logits, params, step0):
    logits = np.array(logits, np.float32)
    st_ = tensors([SamplingParams(**p) for p in params])
    for step in range(step0, step0 + 12):
        tok = draw(logits, st_, step)[0]
        for i, p in enumerate(params):
            if p["temperature"] == 0:
                assert tok[i] == int(np.argmax(logits[i])), (i, p)
                continue
            # A float32 cumsum may land either side of a cut that float64 puts within ~1e-5:
            # compare against the slightly looser set (a superset of the exact one).
            loose = allowed_set(logits[i], p["temperature"], p["top_k"], min(1.0, p["top_p"] + 1e-4),
                                max(0.0, p["min_p"] - 1e-4))
            assert loose[tok[i]], (i, p, int(tok[i]), np.flatnonzero(loose))


# ---- seeds ----------------------------------------------------------------------------------------


def test_same_seed_and_step_give_same_token():
    logits = np.tile(np.random.default_rng(2).normal(size=30).astype(np.float32), (2, 1))
    st_ = tensors([SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=7)])
    a = np.stack([draw(logits, st_, s)[0] for s in range(40)])
    b = np.stack([draw(logits, st_, s)[0] for s in range(40)])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[:, 0], a[:, 1])  # same seed, same logits, same step: same row
    assert len(set(a[:, 0].tolist())) > 5  # ... but the step does change the draw


@pytest.mark.parametrize("own", [dict(temperature=1.0), dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.01)])
def test_seeded_row_is_independent_of_its_batch(own):
    rng = np.random.default_rng(3)
    row = rng.normal(size=30).astype(np.float32) * 2
    mine = SamplingParams(seed=1234, **own)
    alone = np.array([draw(row[None], tensors([mine]), s)[0][0] for s in range(60)])
    others = [SamplingParams(temperature=0.5, top_k=2, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, seed=99)]
    for pos in (0, 2):
        params = others[:pos] + [mine] + others[pos:]
        logits = rng.normal(size=(len(params), 30)).astype(np.float32)
        logits[pos] = row
        counts = rng.integers(0, 3, size=logits.shape).astype(np.int32)
        counts[pos] = 0  # our row's own penalties are off; only the neighbours' state changes
        st_ = tensors(params, batch=8)
        pad = np.zeros((8 - len(params), 30), np.float32)
        got = np.array([draw(np.vstack([logits, pad]), st_, s, counts=np.vstack([counts, pad.astype(np.int32)]))[0][pos]
                        for s in range(60)])
        np.testing.assert_array_equal(got, alone)


def test_different_seeds_draw_differently():
    logits = np.zeros((4, 32), np.float32)  # uniform: every seed/step pair is a fresh draw
    st_ = tensors([SamplingParams(temperature=1.0, seed=s) for s in (0, 1, 2, 12345)])
    toks = np.stack([draw(logits, st_, s)[0] for s in range(40)])  # [steps, rows]
    for i in range(4):
        for j in range(i + 1, 4):
            agree = np.mean(toks[:, i] == toks[:, j])
            assert agree < 0.3, (i, j, agree)  # independent uniform draws agree ~1/32 of the time


def test_step_is_per_row():
    """Row b's key is fold_in(seed_b, step_b): shifting one row's step changes only that row."""
    logits = np.zeros((2, 32), np.float32)
    st_ = tensors([SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=1.0, seed=5)])
    seq = np.array([draw(logits, st_, s)[0][0] for s in range(30)])
    shifted = np.array([draw(logits, st_, [s, s + 1])[0][1] for s in range(30)])
    np.testing.assert_array_equal(shifted[:-1], seq[1:])


# ---- distribution -----------------------------------------------------------------------------------

# Chi-square critical value at p = 1e-3 for df = 1..11 (the draws are seeded, so the test is deterministic).
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.0, top_k=4),
                                dict(temperature=1.0, top_p=0.8), dict(temperature=1.3, min_p=0.1)])
def test_empirical_frequencies_match_softmax(kw):
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.4, 0.7, -0.2, 0.9], np.float32)
    rows, steps = 8, 250  # 2000 draws: 8 seeds x 250 steps
    st_ = tensors([SamplingParams(seed=1000 + r, **kw) for r in range(rows)])
    tok = np.concatenate([draw(np.tile(logits, (rows, 1)), st_, s)[0] for s in range(steps)])
    n = tok.size
    expect = filtered_probs(logits, **kw)
    obs = np.bincount(tok, minlength=logits.size)
    assert not obs[expect == 0].any(), "a filtered-out token was sampled"
    support = expect > 0
    chi2 = float(np.sum((obs[support] - n * expect[support]) ** 2 / (n * expect[support])))
    df = int(support.sum()) - 1
    assert chi2 < CHI2_999[df - 1], (chi2, df, obs / n, expect)
    assert np.abs(obs / n - expect).max() < 0.04


# ---- penalties ------------------------------------------------------------------------------------


def _penalty_case(seed, b=3, v=20):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    counts = rng.integers(0, 4, size=(b, v)).astype(np.int32) * (rng.random((b, v)) < 0.4)
    prompt_mask = rng.random((b, v)) < 0.3
    return logits, counts.astype(np.int32), prompt_mask


def test_presence_and_frequency_subtract_exactly():
    logits, counts, prompt_mask = _penalty_case(0)
    pres, freq = np.array([0.5, 0.0, -1.0]), np.array([0.0, 0.7, 1.5])
    st_ = tensors([SamplingParams(presence_penalty=float(p), frequency_penalty=float(f)) for p, f in zip(pres, freq)])
    out = np.asarray(_penalties(jnp.asarray(logits), st_, jnp.asarray(counts), jnp.asarray(prompt_mask)))
    expect = logits - pres[:, None] * (counts > 0) - freq[:, None] * counts
    np.testing.assert_allclose(out, expect, rtol=0, atol=1e-5)
    # Prompt-only tokens are not penalised by presence/frequency (OpenAI semantics: generated tokens only).
    only_prompt = prompt_mask & (counts == 0)
    assert only_prompt.any()
    np.testing.assert_array_equal(out[only_prompt], logits[only_prompt])


def test_repetition_divides_positive_multiplies_negative_of_seen_tokens():
    logits, counts, prompt_mask = _penalty_case(1)
    rep = np.array([2.0, 1.0, 0.5], np.float32)
    st_ = tensors([SamplingParams(repetition_penalty=float(r)) for r in rep])
    out = np.asarray(_penalties(jnp.asarray(logits), st_, jnp.asarray(counts), jnp.asarray(prompt_mask)))
    seen = (counts > 0) | prompt_mask
    assert (seen & (logits > 0)).any() and (seen & (logits < 0)).any() and (~seen).any()
    r = rep[:, None]
    pos, neg = seen & (logits > 0), seen & (logits <= 0)
    np.testing.assert_allclose(out[pos], (logits / r * np.ones_like(logits))[pos], rtol=1e-6)
    np.testing.assert_allclose(out[neg], (logits * r * np.ones_like(logits))[neg], rtol=1e-6)
    np.testing.assert_array_equal(out[~seen], logits[~seen])
    np.testing.assert_array_equal(out[1], logits[1])  # penalty 1 is the identity
    # Every seen token of row 0 (penalty 2) got less likely, whatever its sign.
    assert (out[0][seen[0]] < logits[0][seen[0]]).all()


def test_combined_penalties_follow_vllm_order():
    """vLLM applies repetition first, then frequency and presence."""
    logits, counts, prompt_mask = _penalty_case(2)
    st_ = tensors([SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)] * 3)
    out = np.asarray(_penalties(jnp.asarray(logits), st_, jnp.asarray(counts), jnp.asarray(prompt_mask)))
    seen = (counts > 0) | prompt_mask
    x = np.where(seen, np.where(logits > 0, logits / 1.5, logits * 1.5), logits)
    x = x - 0.2 * counts - 0.3 * (counts > 0)
    np.testing.assert_allclose(out, x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("source", ["generated", "prompt"])
def test_greedy_with_repetition_penalty_avoids_seen_argmax(source):
    logits = np.zeros((2, 16), np.float32)
    logits[:, 3], logits[:, 7], logits[:, 9] = 5.0, 4.0, -1.0
    counts = np.zeros((2, 16), np.int32)
    prompt_mask = np.zeros((2, 16), bool)
    if source == "generated":
        counts[:, 3] = 1
    else:
        prompt_mask[:, 3] = True
    st_ = tensors([SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)])
    tok = draw(logits, st_, 0, counts=counts, prompt_mask=prompt_mask)[0]
    assert tok[0] == 7, tok  # 5 / 2 = 2.5 < 4
    assert tok[1] == 3, tok  # the unpenalised row in the same batch keeps its argmax


def test_sampled_row_with_frequency_penalty_never_draws_banned_token():
    """A huge frequency penalty on a generated token takes it out of a sampled row's reach."""
    logits = np.zeros((1, 8), np.float32)
    logits[0, 2] = 3.0
    counts = np.zeros((1, 8), np.int32)
    counts[0, 2] = 50
    st_ = tensors([SamplingParams(temperature=1.0, frequency_penalty=2.0, seed=9)])
    toks = {int(draw(logits, st_, s, counts=counts)[0][0]) for s in range(200)}
    assert 2 not in toks and len(toks) == 7


# ---- logprobs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, MAX_LOGPROBS])
def test_logprobs_are_of_raw_logits(n):
    rng = np.random.default_rng(4)
    logits = (rng.normal(size=(4, 48)) * 4).astype(np.float32)
    counts = rng.integers(0, 2, size=logits.shape).astype(np.int32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=5, seed=1),
              SamplingParams(temperature=1.0, repetition_penalty=1.8, frequency_penalty=1.0, seed=2),
              SamplingParams(temperature=2.0, top_p=0.5, seed=3)]
    st_ = tensors(params)
    ref = log_softmax(logits)
    for step in range(5):
        tok, tok_lp, top_ids, top_lp = draw(logits, st_, step, counts=counts, num_logprobs=n)
        np.testing.assert_allclose(tok_lp, ref[np.arange(4), tok], rtol=0, atol=1e-5)
        assert top_ids.shape == (4, n) and top_lp.shape == (4, n) and top_ids.dtype == np.int32
        np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=-1, kind="stable")[:, :n])
        np.testing.assert_allclose(top_lp, np.sort(ref, axis=-1)[:, ::-1][:, :n], rtol=0, atol=1e-5)


def test_no_logprobs_gives_empty_arrays():
    tok, tok_lp, top_ids, top_lp = draw(np.zeros((2, 10), np.float32), tensors([SamplingParams(temperature=0.0)] * 2), 0)
    assert top_ids.shape == (2, 0) and top_lp.shape == (2, 0)
    np.testing.assert_allclose(tok_lp, np.log(0.1), atol=1e-6)


# ---- SamplingParams validation ------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", float("nan")),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5),
    ("temperature", -0.5), ("temperature", float("nan")),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1),
    ("seed", "abc"), ("seed", 1.5),
])
def test_invalid_params_raise_naming_field_and_value(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert field in msg and repr(value) in msg, msg


def test_empty_stop_string_rejected():
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=["ok", ""])


def test_validate_catches_later_mutation():
    p = SamplingParams()
    p.top_p = 0.0
    with pytest.raises(InvalidRequestError, match="top_p"):
        p.validate()


def test_valid_edges_accepted_and_normalised():
    p = SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, temperature=0.0, max_tokens=1, stop="x",
                       presence_penalty=-2, frequency_penalty=2, logprobs=0, seed=0)
    assert p.top_k == 0 and p.stop == ["x"] and p.stop_token_ids == []
    st_ = tensors([p, SamplingParams(temperature=0.5, top_k=3, seed=2**32 - 1)], batch=4)
    np.testing.assert_array_equal(np.asarray(st_.top_k), [0, 3, 0, 0])
    np.testing.assert_array_equal(np.asarray(st_.temperature), np.array([0, 0.5, 0, 0], np.float32))
    from rvjax.sampling import seed_key
    np.testing.assert_array_equal(np.asarray(st_.seed), np.array([seed_key(0), seed_key(2**32 - 1), 0, 0], np.uint32))
    assert len({seed_key(s) for s in (5, 2**32 + 5, -5, 2**70)}) == 4
    assert np.asarray(st_.repetition).tolist() == [1.0, 1.0, 1.0, 1.0]



def test_negative_seed_rejected_up_front_or_usable():
    try:
        p = SamplingParams(seed=-1)
    except InvalidRequestError as e:
        assert "-1" in str(e)
        return
    st_ = tensors([p])  # accepted by validation, so the engine must be able to use it
    assert draw(np.zeros((1, 8), np.float32), st_, 0)[0].shape == (1,)
