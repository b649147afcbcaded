"""Reference paged attention in plain jnp: the definition every kernel is checked against."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from paged_jax.attention import kv_quant

# Hooks for variants (flex-attention style), applied to float32 scores after scaling:
#   score_mod(scores [S, KVH, G, Q, L], q_pos [S, 1, 1, Q, 1], k_pos [1, 1, 1, 1, L]) -> scores
#   mask_mod(q_pos, k_pos) -> bool, broadcastable to scores; True where a key may be seen
#   (in addition to the causal mask and the sequence length, which always apply).
# The blockwise prefill (prefill.py, what the backends run) calls the same hooks on one tile at a time,
# [S, KVH, G, q_chunk, kv_chunk] with that tile's absolute positions: write hooks elementwise in
# (score, q_pos, k_pos), never depending on the full Q or L.
ScoreMod = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
MaskMod = Callable[[jax.Array, jax.Array], jax.Array]


def paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, *,
                              score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None,
                              sinks=None):
    """Causal attention of each sequence's new queries over its paged K/V.

    q:            [S, Q, num_heads, head_dim], query ``i`` of sequence ``s`` sits at
                  position ``context_lens[s] - query_lens[s] + i``; rows ``i >= query_lens[s]``
                  are padding (their output is unspecified).
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: int32 [S, max_blocks]
    context_lens, query_lens: int32 [S]
    score_mod, mask_mod: optional hooks (see above) for attention variants.
    sinks:        optional float32 [num_heads]: each head's sink logit, one more term in its softmax's
                  denominator (``exp(sink)``) whose value is zero (:class:`AttentionSpec` ``sinks``).
    Returns [S, Q, num_heads, head_dim] in q's dtype; softmax in float32.
    """
    S, Q, H, D = q.shape
    _, block_size, KVH, _ = k_cache.shape
    G = H // KVH
    L = block_tables.shape[1] * block_size
    k = kv_quant.dequantize(k_cache[block_tables], D, q.dtype).reshape(S, L, KVH, D)  # 8-bit caches: to q's dtype
    v = kv_quant.dequantize(v_cache[block_tables], D, q.dtype).reshape(S, L, KVH, D)
    qg = q.reshape(S, Q, KVH, G, D)
    scores = jnp.einsum("sqkgd,slkd->skgql", qg, k, preferred_element_type=jnp.float32) * scale
    q_pos = ((context_lens - query_lens)[:, None] + jnp.arange(Q)[None, :])[:, None, None, :, None]
    k_pos = jnp.arange(L)[None, None, None, None, :]
    if score_mod is not None:
        scores = score_mod(scores, q_pos, k_pos)
    mask = (k_pos <= q_pos) & (k_pos < context_lens[:, None, None, None, None])
    if mask_mod is not None:
        mask = mask & mask_mod(q_pos, k_pos)
    scores = jnp.where(mask, scores, -1e30)
    if sinks is not None:  # the sink as one more key, dropped after the softmax
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(1, KVH, G, 1, 1), (S, KVH, G, Q, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :L]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    # Zero the values of slots past each context: a stale Inf/NaN there must not reach probs @ v.
    v = jnp.where((jnp.arange(L)[None, :] < context_lens[:, None])[:, :, None, None], v, 0)
    out = jnp.einsum("skgql,slkd->sqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(S, Q, H, D).astype(q.dtype)
