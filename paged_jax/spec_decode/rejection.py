"""The general rejection sampler (Leviathan et al. 2023, Chen et al. 2023), for drafts drawn from a
draft model's distribution ``q``: the emitted tokens follow the target's distribution ``p`` exactly.

For each row, draft ``x_j`` (drawn from ``q_j``) is accepted with probability ``min(1, p_j(x_j) /
q_j(x_j))``, in order, until the first rejection. At the first rejected position ``n`` the next token
is drawn from ``norm(max(0, p_n - q_n))``; when every draft was accepted, from ``p`` at the position
after the last draft (the "bonus" token). The row emits its accepted drafts and that token.

Why the emitted token at a position follows ``p``: it is ``x`` with probability ``q(x) min(1, p(x) /
q(x)) = min(q(x), p(x))``, or it is drawn from the residual after a rejection, whose probability is
``1 - sum_x min(p, q) = sum_x max(0, p - q)``, which gives ``max(0, p(x) - q(x))``; the two add to
``p(x)``.

The n-gram proposer's drafts are the special case of a ``q`` that puts all its mass on ``x`` (the
engine then draws with plain decoding's keys instead, see :mod:`.decoder`). Randomness comes in as
arrays (two uniforms per position), so a caller can derive them from per-request seeds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def rejection_sample(target_probs: jax.Array, draft_probs: jax.Array, draft_tokens: jax.Array,
                     num_drafts: jax.Array, accept_uniforms: jax.Array, resample_uniforms: jax.Array):
    """Verify each row's drafts against the target.

    ``target_probs`` float[R, K + 1, V]: ``p`` at each draft's position and the one after the last;
    ``draft_probs`` float[R, K, V]: ``q`` the drafts were drawn from; ``draft_tokens`` int[R, K];
    ``num_drafts`` int[R] (<= K: positions past it are ignored); ``accept_uniforms`` float[R, K] and
    ``resample_uniforms`` float[R], uniform in [0, 1).

    Returns ``(num_accepted int32[R], next_token int32[R])``: the row emits
    ``draft_tokens[:num_accepted]`` and then ``next_token``.
    """
    R, K1, V = target_probs.shape
    K = K1 - 1
    p_x = jnp.take_along_axis(target_probs[:, :K], draft_tokens[..., None], -1)[..., 0]  # [R, K]
    q_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    # u < p / q, written without the division (q(x) > 0 for a token drawn from q).
    accepted = (accept_uniforms * q_x < p_x) & (jnp.arange(K)[None] < num_drafts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)
    p_n = jnp.take_along_axis(target_probs, num_accepted[:, None, None], 1)[:, 0]  # [R, V]
    q_n = jnp.take_along_axis(jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0))), num_accepted[:, None, None], 1)[:, 0]
    rejected = num_accepted < num_drafts
    residual = jnp.where(rejected[:, None], jnp.maximum(p_n - q_n, 0.0), p_n)
    # p == q at a rejected position has probability zero; rounding can still empty the residual: use p.
    empty = jnp.sum(residual, axis=-1, keepdims=True) <= 0
    residual = jnp.where(empty, p_n, residual)
    cdf = jnp.cumsum(residual, axis=-1)
    threshold = resample_uniforms[:, None] * cdf[:, -1:]
    # The first token whose cumulative mass passes the threshold; never past the last token of the
    # residual's support (rounding at the top of the cdf).
    last = V - 1 - jnp.argmax((residual > 0)[:, ::-1], axis=-1)
    next_token = jnp.minimum(jnp.sum(cdf <= threshold, axis=-1), last)
    return num_accepted.astype(jnp.int32), next_token.astype(jnp.int32)
