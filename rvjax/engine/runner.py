"""Jitted entry points over a static batch: chunked prefill, and decode windows of K steps that run
forward, sample, append, and stop checks inside one `lax.while_loop` with no host sync (Blink's point:
the host only dispatches windows and reads their outboxes)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rvjax.cache import KVCache
from rvjax.config import ModelConfig
from rvjax.models import family
from rvjax.sampling import SamplingTensors, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Device-resident per-row state of a static batch. All [B] unless noted."""

    tokens: jax.Array  # int32: last sampled token, not yet in the cache
    pos: jax.Array  # int32: the position of `tokens` (written into the cache by the next step)
    generated: jax.Array  # int32: tokens sampled so far
    max_tokens: jax.Array  # int32
    done: jax.Array  # bool
    stop_ids: jax.Array  # int32 [B, M], -1 padded
    counts: jax.Array  # int32 [B, V]: generated-token histogram (presence/frequency penalties)
    prompt_mask: jax.Array  # bool [B, V]: tokens of the prompt (repetition penalty)
    sampling: SamplingTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Outbox:
    """One window's results: token -1 where a row produced nothing."""

    tokens: jax.Array  # int32 [B, K]
    logprobs: jax.Array  # float32 [B, K]
    top_ids: jax.Array  # int32 [B, K, N]
    top_logprobs: jax.Array  # float32 [B, K, N]
    done: jax.Array  # bool [B] at the window's end
    steps: jax.Array  # int32: steps the window ran


def _last_hidden(h, lengths, start, last_h):
    """Keep, per row, the hidden state of its last prompt token if it lies in this chunk."""
    idx = lengths - 1 - start  # [B]
    inside = (idx >= 0) & (idx < h.shape[1])
    picked = jnp.take_along_axis(h, jnp.clip(idx, 0, h.shape[1] - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where(inside[:, None], picked, last_h)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache", "last_h"))
def prefill_chunk(weights, cfg: ModelConfig, tokens, start, lengths, cache: KVCache, last_h):
    """tokens [B, C] at positions start .. start+C-1 (start a scalar) into the cache; updates last_h [B, D]."""
    b, c = tokens.shape
    valid = jnp.clip(lengths - start, 0, c)  # padding past a prompt's end must not enter a ring buffer
    h, cache = family(cfg.family).forward(weights, cfg, tokens, jnp.full((b,), start, jnp.int32), cache, valid)
    return _last_hidden(h, lengths, start, last_h), cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def chunk_logits(weights, cfg: ModelConfig, tokens, start, lengths, cache: KVCache):
    """Float32 logits [B, C, V] for every position of a chunk (evaluation)."""
    b, c = tokens.shape
    mod = family(cfg.family)
    h, cache = mod.forward(weights, cfg, tokens, jnp.full((b,), start, jnp.int32), cache,
                           jnp.clip(lengths - start, 0, c))
    return mod.logits(weights, cfg, h), cache


def _record(state: DecodeState, tok, active, max_len):
    """Append tok where active; finish rows that hit a stop id, max_tokens or the context end."""
    b = tok.shape[0]
    counts = state.counts.at[jnp.arange(b), tok].add(active.astype(jnp.int32))
    generated = state.generated + active
    hit_stop = jnp.any(tok[:, None] == state.stop_ids, axis=-1)
    pos = state.pos + active
    # prompt + generated may not exceed the cache: the token at max_len - 1 is the last one.
    finished = active & (hit_stop | (generated >= state.max_tokens) | (pos >= max_len - 1))
    return dataclasses.replace(state, tokens=jnp.where(active, tok, state.tokens), pos=pos, generated=generated,
                               done=state.done | finished, counts=counts)


@functools.partial(jax.jit, static_argnames=("cfg", "num_logprobs"), donate_argnames=("state",))
def first_token(weights, cfg: ModelConfig, last_h, state: DecodeState, max_len, num_logprobs: int):
    """Sample each row's first token from its last prompt position (state.pos = prompt length - 1)."""
    logits = family(cfg.family).logits(weights, cfg, last_h)
    tok, lp, ti, tl = sample(logits, state.sampling, state.counts, state.prompt_mask, state.generated, num_logprobs)
    active = ~state.done
    return _record(state, tok, active, max_len), (jnp.where(active, tok, -1), lp, ti, tl)


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "num_logprobs"), donate_argnames=("state", "cache"))
def decode_window(weights, cfg: ModelConfig, state: DecodeState, cache: KVCache, steps: int, num_logprobs: int):
    """Up to `steps` decode steps for every unfinished row; returns (state, cache, Outbox)."""
    mod = family(cfg.family)
    b = state.tokens.shape[0]
    max_len = cache.max_len
    out0 = Outbox(
        tokens=jnp.full((b, steps), -1, jnp.int32), logprobs=jnp.zeros((b, steps), jnp.float32),
        top_ids=jnp.zeros((b, steps, num_logprobs), jnp.int32),
        top_logprobs=jnp.zeros((b, steps, num_logprobs), jnp.float32),
        done=state.done, steps=jnp.int32(0))

    def cond(carry):
        state, _, out = carry
        return (out.steps < steps) & ~jnp.all(state.done)

    def body(carry):
        state, cache, out = carry
        h, cache = mod.forward(weights, cfg, state.tokens[:, None], state.pos, cache)
        logits = mod.logits(weights, cfg, h[:, 0])
        tok, lp, ti, tl = sample(logits, state.sampling, state.counts, state.prompt_mask, state.generated,
                                 num_logprobs)
        active = ~state.done
        i = out.steps
        out = Outbox(
            tokens=out.tokens.at[:, i].set(jnp.where(active, tok, -1)), logprobs=out.logprobs.at[:, i].set(lp),
            top_ids=out.top_ids.at[:, i].set(ti), top_logprobs=out.top_logprobs.at[:, i].set(tl),
            done=out.done, steps=i + 1)
        return _record(state, tok, active, max_len), cache, out

    state, cache, out = jax.lax.while_loop(cond, body, (state, cache, out0))
    return state, cache, dataclasses.replace(out, done=state.done)


@functools.partial(jax.jit, donate_argnames=("state",))
def finish_rows(state: DecodeState, rows):
    """Mark rows done from the host (a stop string matched in the detokenized text)."""
    return dataclasses.replace(state, done=state.done | rows)
