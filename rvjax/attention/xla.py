"""The XLA reference attention, correct on every backend: dense GQA over one or more sets of keys at explicit
positions, and blockwise online-softmax attention over a long cache that never materializes the full score
matrix.

A step's queries attend over the cache as it was before the step plus the step's own keys, each a separate
key set: the cache is never concatenated with (copied into) anything, and the step's write can happen
after attention, or after a whole scanned layer loop.

Einsum legend (rvjax/models/layers.py): B batch, T query tokens, S key tokens, K kv heads, G query heads
per kv head, H head dim. Scores and the softmax are float32 whatever the KV dtype."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

KeySet = tuple  # (k [B, S, K, H], v [B, S, K, H], k_pos [B, S]); k_pos < 0 marks an empty slot


def _scores(q, k, scale, softcap):
    """q [B, T, N, H], k [B, S, K, H] -> float32 scores [B, K, G, T, S]."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


def visible(q_pos, k_pos, window):
    """[B, T, S]: key at k_pos is visible to the query at q_pos. k_pos < 0 marks an empty slot.
    A window W keeps q_pos - k_pos < W (HF's convention: the query and W - 1 keys before it)."""
    vis = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        vis &= q_pos[:, :, None] - k_pos[:, None, :] < window
    return vis


def _masked_scores(q, q_pos, key_set: KeySet, scale, window, softcap):
    k, _, k_pos = key_set
    s = _scores(q, k, scale, softcap)
    return jnp.where(visible(q_pos, k_pos, window)[:, None, None], s, -jnp.inf)


def dense(q, q_pos, key_sets: Sequence[KeySet], *, scale: float, window: int | None = None,
          softcap: float | None = None):
    """Causal (optionally sliding-window) GQA attention of q [B, T, N, H] at q_pos [B, T] over the union of
    the key sets. Every query must see at least one key (its own position), so no softmax row is empty."""
    b, t, n, h = q.shape
    scores = [_masked_scores(q, q_pos, ks, scale, window, softcap) for ks in key_sets]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out, at = 0.0, 0
    for (_, v, _), s in zip(key_sets, scores):
        p = probs[..., at: at + s.shape[-1]].astype(v.dtype)
        out = out + jnp.einsum("bkgts,bskh->btkgh", p, v, preferred_element_type=jnp.float32)
        at += s.shape[-1]
    return out.reshape(b, t, n, h).astype(q.dtype)


def _merge(state, s, v):
    """One online-softmax step: fold scores s [B, K, G, T, S] over values v [B, S, K, H] into (m, l, acc)."""
    m, denom, acc = state
    m_new = jnp.maximum(m, s.max(axis=-1))
    # A block can be wholly masked for a row (a window that ends before it): keep exp() finite there.
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    acc = acc * corr[..., None] + jnp.einsum("bkgts,bskh->bkgth", p, v.astype(jnp.float32))
    return m_new, denom * corr + p.sum(axis=-1), acc


def blockwise(q, q_pos, read_block, num_blocks, block: int, kv_heads: int, *, extra: KeySet | None, scale: float,
              window: int | None = None, softcap: float | None = None):
    """Online-softmax attention over `extra` (the step's own keys, or None when the cache already holds
    them) and a cache read `block` keys at a time.

    read_block(i) -> (k, v, k_pos) for cache keys i*block .. (i+1)*block - 1. Only `num_blocks` blocks are
    read (a traced value: blocks past the newest position are skipped). Peak memory is one block of scores
    [B, K, G, T, block], whatever the context (rvLLM §8.2, BLOCK_K)."""
    b, t, n, h = q.shape
    kh, g = kv_heads, n // kv_heads
    state = (jnp.full((b, kh, g, t), -jnp.inf, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
             jnp.zeros((b, kh, g, t, h), jnp.float32))
    if extra is not None:
        state = _merge(state, _masked_scores(q, q_pos, extra, scale, window, softcap), extra[1])

    def body(i, state):
        key_set = read_block(i)
        return _merge(state, _masked_scores(q, q_pos, key_set, scale, window, softcap), key_set[1])

    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, state)
    out = acc / denom[..., None]  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
