"""The XLA reference attention, correct on every backend: dense GQA over explicit key positions, and
blockwise online-softmax attention over a long cache that never materializes the full score matrix.

Einsum legend (rvjax/models/layers.py): B batch, T query tokens, S key tokens, K kv heads, G query heads
per kv head, H head dim. Scores and the softmax are float32 whatever the KV dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def dense(q, k, v, q_pos, k_pos, *, scale: float, window: int | None = None, softcap: float | None = None):
    """Causal (optionally sliding-window) GQA attention.

    q [B, T, N, H] at q_pos [B, T]; k, v [B, S, K, H] at k_pos [B, S]. Every query must see at least one
    key (its own position), so no row of the softmax is empty."""
    b, t, n, h = q.shape
    scores = _scores(q, k, scale, softcap)
    scores = jnp.where(visible(q_pos, k_pos, window)[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


def blockwise(q, q_pos, read_block, num_blocks, block: int, kv_heads: int, *, scale: float,
              window: int | None = None, softcap: float | None = None):
    """Online-softmax attention over a cache read `block` keys at a time (key s at position s).

    read_block(i) -> (k, v) [B, block, K, H] for keys i*block .. (i+1)*block - 1. Only blocks up to the
    largest query position are read: `num_blocks` may be a traced value. Peak memory is one block of
    scores [B, K, G, T, block], whatever the context (rvLLM §8.2, BLOCK_K)."""
    b, t, n, h = q.shape
    kh, g = kv_heads, n // kv_heads
    m0 = jnp.full((b, kh, g, t), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((b, kh, g, t), jnp.float32)
    acc0 = jnp.zeros((b, kh, g, t, h), jnp.float32)

    def body(i, carry):
        m, l, acc = carry
        k, v = read_block(i)
        s = _scores(q, k, scale, softcap)
        k_pos = jnp.broadcast_to(i * block + jnp.arange(block, dtype=jnp.int32), (b, block))
        s = jnp.where(visible(q_pos, k_pos, window)[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        # A block can be wholly masked for a row (a window that ends before it): keep exp() finite there.
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(m - m_safe)
        l = l * corr + p.sum(axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("bkgts,bskh->bkgth", p, v.astype(jnp.float32))
        return m_new, l, acc

    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, (m0, l0, acc0))
    out = acc / l[..., None]  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
