"""Decode attention in plain jnp: one new query per sequence, laid out for the CPU.

The same function as :func:`paged_attention_reference` restricted to ``Q = 1`` (so the
causal mask is the length mask), written so that XLA's CPU backend runs it well: the
gathered K and V are put head-major (``[S, KVH, L, D]``) before the two contractions,
which then have their batch dimensions leading. With ``[S, L, KVH, D]`` operands XLA
transposes inside each contraction, and a decode step at batch 32 spent about 2.5x
longer in attention (``experiments/roofline.py``). Large batches run a few sequences at
a time (``lax.map``), so that each group's gathered K and V (about 1,024 tokens) stay in
the CPU's caches: 3x faster at 128 sequences of 128 or 512 tokens.

This is the ``"reference"`` backend's decode (plain jnp, no C++). The ``"native"`` backend
(``paged_jax/native``, the engine's choice on a CPU where it builds) reads K/V through the
block table without gathering them, 3-6x faster again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.attention import kv_quant


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, tokens_per_group: int = 1024,
                           sinks=None):
    """q: [S, num_heads, head_dim], the newest token of each sequence (at position
    ``context_lens[s] - 1``); caches ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    block_tables int32 [S, max_blocks]. Returns [S, num_heads, head_dim] in q's dtype;
    softmax in float32. Rows with ``context_lens == 0`` (padding) give unspecified values. ``sinks``:
    float32 [num_heads] sink logits (see :func:`~paged_jax.attention.reference.paged_attention_reference`)."""
    S = q.shape[0]
    L = block_tables.shape[1] * k_cache.shape[1]
    group = max(4, tokens_per_group // L)
    if S <= group or S % group:
        return _decode_rows(q, k_cache, v_cache, block_tables, context_lens, scale, sinks)
    n = S // group
    out = jax.lax.map(lambda a: _decode_rows(a[0], k_cache, v_cache, a[1], a[2], scale, sinks),
                      (q.reshape(n, group, *q.shape[1:]), block_tables.reshape(n, group, -1),
                       context_lens.reshape(n, group)))
    return out.reshape(q.shape)


def _decode_rows(q, k_cache, v_cache, block_tables, context_lens, scale, sinks=None):
    S, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    G = H // KVH
    L = block_tables.shape[1] * block_size
    # an 8-bit cache is dequantized as gathered (kv_quant); a float one passes through as it is
    k = kv_quant.dequantize(k_cache[block_tables], D, q.dtype).reshape(S, L, KVH, D).transpose(0, 2, 1, 3)
    v = kv_quant.dequantize(v_cache[block_tables], D, q.dtype).reshape(S, L, KVH, D).transpose(0, 2, 1, 3)
    qg = q.reshape(S, KVH, G, D)
    scores = jnp.einsum("skgd,skld->skgl", qg, k, preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(L)[None, :] < context_lens[:, None]  # [S, L]
    scores = jnp.where(valid[:, None, None, :], scores, -1e30)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink as one more key, dropped after the softmax
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(1, KVH, G, 1), (S, KVH, G, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :L]
    v = jnp.where(valid[:, None, :, None], v, 0)  # a stale Inf/NaN in an unused slot must not reach probs @ v
    out = jnp.einsum("skgl,skld->skgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(S, H, D).astype(q.dtype)
