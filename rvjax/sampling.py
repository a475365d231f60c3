"""Per-request sampling parameters, held on the device as padded [B] arrays, and the jitted sampler.

`SamplingParams` is the user-facing, validated, host-side record (vLLM names). `SamplingTensors`
stacks a batch of them so one compiled sampler serves every mix of greedy and sampled requests."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rvjax.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
    """What to generate, per request. temperature=0 is greedy; top_k=0 (or -1) and top_p=1 disable those filters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg):
            raise InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be 0 (off), -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not self.repetition_penalty > 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an integer, got {self.seed!r}")


def seed_key(seed: int) -> int:
    """Any Python int (negative, or past 64 bits) to a 32-bit key root; distinct seeds stay distinct
    in practice (5 and 2**32 + 5 do not collide as they would modulo 2**32)."""
    return int.from_bytes(hashlib.blake2b(str(int(seed)).encode(), digest_size=4).digest(), "little")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingTensors:
    """A batch of SamplingParams as device arrays, all [B]."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = off
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32
    presence: jax.Array  # float32
    frequency: jax.Array  # float32
    repetition: jax.Array  # float32
    seed: jax.Array  # uint32: per-request key root, so the same seed gives the same text in any batch

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], batch: int, rng: np.random.Generator) -> "SamplingTensors":
        """Stack params, padded to `batch` rows with greedy defaults. Unseeded requests draw a seed from rng."""
        pad = batch - len(params)

        def col(f, dtype, fill):
            return jnp.asarray(np.array([f(p) for p in params] + [fill] * pad, dtype=dtype))

        seeds = [seed_key(p.seed) if p.seed is not None else int(rng.integers(0, 2**32)) for p in params]
        return cls(
            temperature=col(lambda p: p.temperature, np.float32, 0.0),
            top_k=col(lambda p: p.top_k, np.int32, 0),
            top_p=col(lambda p: p.top_p, np.float32, 1.0),
            min_p=col(lambda p: p.min_p, np.float32, 0.0),
            presence=col(lambda p: p.presence_penalty, np.float32, 0.0),
            frequency=col(lambda p: p.frequency_penalty, np.float32, 0.0),
            repetition=col(lambda p: p.repetition_penalty, np.float32, 1.0),
            seed=jnp.asarray(np.array(seeds + [0] * pad, dtype=np.uint32)),
        )


def apply_penalties(logits: jax.Array, st: SamplingTensors, counts: jax.Array, prompt_mask: jax.Array) -> jax.Array:
    """logits [B, V]; counts [B, V] int32 of generated tokens; prompt_mask [B, V] bool of prompt tokens.

    Repetition (CTRL / HF / vLLM): tokens seen in prompt or output get positive logits divided and
    negative ones multiplied by the penalty. Presence / frequency (OpenAI): over generated tokens only,
    logit -= presence * [count > 0] + frequency * count."""
    seen = (counts > 0) | prompt_mask
    r = st.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - st.frequency[:, None] * counts - st.presence[:, None] * (counts > 0)
    return logits


def _filter(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf."""
    scaled = logits / jnp.maximum(st.temperature, 1e-6)[:, None]
    vocab = scaled.shape[-1]

    def sorted_filters(x):
        desc = -jnp.sort(-x, axis=-1)  # [B, V] descending
        k = jnp.where(st.top_k > 0, jnp.minimum(st.top_k, vocab), vocab)
        kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
        x = jnp.where(x < kth, -jnp.inf, x)
        # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p (ties kept).
        probs = jax.nn.softmax(jnp.where(desc < kth, -jnp.inf, desc), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted token
        cut = jnp.sum(before < st.top_p[:, None], axis=-1)  # tokens kept, >= 1
        pth = jnp.take_along_axis(desc, (cut - 1)[:, None], axis=-1)
        # top_p = 1 keeps every token: float32 cumsums reach 1 early and would cut the far tail.
        pth = jnp.where(st.top_p[:, None] >= 1.0, -jnp.inf, pth)
        return jnp.where(x < pth, -jnp.inf, x)

    # The full-vocab sort is the expensive part: skip it when no row asks for top-k or top-p.
    needs_sort = jnp.any((st.top_k > 0) | (st.top_p < 1.0))
    scaled = jax.lax.cond(needs_sort, sorted_filters, lambda x: x, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    pmax = jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < st.min_p[:, None] * pmax, -jnp.inf, scaled)


def sample(logits: jax.Array, st: SamplingTensors, counts: jax.Array, prompt_mask: jax.Array,
           step: jax.Array, num_logprobs: int = 0):
    """Next tokens [B] int32, their logprobs [B], and the top `num_logprobs` (ids, logprobs) [B, N].

    step [B] is each request's generated-token count: the key for row b is fold_in(seed_b, step_b),
    so a seeded request samples the same tokens whatever else is in the batch. Logprobs are of the
    model's raw distribution (before penalties and temperature), as vLLM reports them."""
    raw_lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    x = logits.astype(jnp.float32)
    penalised = jnp.any((st.repetition != 1.0) | (st.frequency != 0.0) | (st.presence != 0.0))
    x = jax.lax.cond(penalised, lambda x: apply_penalties(x, st, counts, prompt_mask), lambda x: x, x)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)

    def draw(x):
        filt = _filter(x, st)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(st.seed, step)
        u = jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float32))(keys)  # [B]
        # Inverse-CDF draw: one uniform per row instead of V Gumbel samples.
        cdf = jnp.cumsum(jax.nn.softmax(filt, axis=-1), axis=-1)
        tok = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
        # Round-off can push the draw past the last allowed token: clamp onto the allowed set.
        allowed = jnp.take_along_axis(filt, tok[:, None], axis=-1)[:, 0] > -jnp.inf
        return jnp.where(allowed, tok, jnp.argmax(filt, axis=-1).astype(jnp.int32))

    any_sampled = jnp.any(st.temperature > 0)
    sampled = jax.lax.cond(any_sampled, draw, lambda x: greedy, x)
    tokens = jnp.where(st.temperature > 0, sampled, greedy)
    token_lp = jnp.take_along_axis(raw_lp, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_lp, num_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, token_lp, top_ids.astype(jnp.int32), top_lp
