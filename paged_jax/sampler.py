"""The sampler: one jitted, vectorised step from logits to next tokens.

Per step the engine does::

    rows = [(seq_group.sampling_params,
             seed_for_sample(params.seed, sample_index) if params.seed is not None else None,
             seq.prompt_token_ids, seq.output_token_ids) for each running sequence]
    tensors = SamplingTensors.from_params(rows, vocab_size, pad_to=S,
                                          eos_token_id=eos, engine_seed=seed, step=step)
    out = sample(logits, tensors)          # logits: float[S, V], S = the batch bucket
    ids, lps, top_ids, top_lps = jax.device_get(out)   # only the first len(rows) rows matter

Semantics follow vLLM 0.2/0.3, in this order, every row independently:

1. ``min_tokens``: EOS and ``stop_token_ids`` get logit -inf while the output is
   shorter than ``min_tokens`` (``from_params`` lists them in ``banned_token_ids``).
2. Penalties: repetition (HF/CTRL: divide positive logits, multiply negative ones,
   for tokens seen in the prompt or the output), then frequency
   (``-= f * count in output``) and presence (``-= p * [token in output]``).
   The counts are built inside jit by a scatter-add over the vocabulary.
3. Temperature (greedy rows use 1.0, so their logprobs are the plain log_softmax
   of the penalised logits).
4. top-k: keep logits >= the k-th largest (ties at the threshold are all kept).
5. top-p, on the renormalised top-k distribution: drop a token when the mass of
   all tokens with probability <= its own is <= 1 - top_p (vLLM 0.3's ascending
   cumsum rule; the most likely token always stays; ties are kept or dropped
   together, where a sort would split them by index).
6. min-p: drop tokens with probability < min_p * max probability.
7. ``logprobs = log_softmax(processed logits)`` (masked tokens: -inf). Greedy
   rows take the argmax, random rows draw from ``exp(logprobs)``.

Output: :class:`SamplerOutput` with the token ids [S] int32, their logprobs [S],
and the ``num_top`` best ids / logprobs [S, num_top], sorted best first.

**No sort.** Sorting [256, 50k] floats takes ~2 s on this CPU. top-k and top-p
find their thresholds by bisection on the float bit patterns (32 and 30
counting passes: exact, ~0.1 s each at that size), and a draw is an inverse-CDF
lookup with one uniform per row through 256-token blocks (one reduction pass,
then a cumsum over the blocks and over one block).

**Randomness.** Each row draws one uniform from its own key, never from a key
carried across steps:

* seeded row: ``fold_in(PRNGKey(seed), number of tokens this sequence has
  generated)``; ``PRNGKey(seed)`` here means threefry key data
  ``[seed >> 32, seed & 0xffffffff]`` of ``seed mod 2**64`` (equal to
  ``jax.random.PRNGKey(seed)`` for 0 <= seed < 2**32). The token therefore does
  not depend on the batch, the row position, preemption or recomputation. Give
  each sample of an ``n > 1`` request its own seed with :func:`seed_for_sample`.
* unseeded row ``i``: ``fold_in(PRNGKey(splitmix64(splitmix64(engine_seed) ^ step)), i)``;
  the caller passes a ``step`` counter that it increments every call.

The per-row parameters are packed on the host by :class:`SamplingTensors`
(``paged_jax/sampling_tensors.py``); this module is the jitted part.

**Compiled variants.** ``sample`` is one ``jax.jit`` function; the static part
of its input is the tree structure of :class:`SamplingTensors`, whose meta fields
(``all_greedy``, ``do_penalties``, ``do_top_k``, ``do_top_p``, ``do_min_p``,
``num_top``) select the code path, so every combination is its own executable and
the all-greedy, no-penalty case is a bare argmax + log-softmax gather. A compile is
keyed by: S, V, those flags, and the widths of the id arrays (prompt/output ids
for penalties, banned ids), which ``from_params`` rounds up to powers of two
(0 when unused). ``num_top`` is also rounded up to a power of two.
Greedy implies no top-k/top-p/min-p, so at most 2 greedy + 16 random flag
combinations exist; a typical workload sees 2 or 3. ``sample._cache_size()``
gives the number compiled so far.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from paged_jax.sampling_tensors import PAD_ID, SamplingTensors
from paged_jax.seeds import seed_for_sample

_CDF_BLOCK = 256


class SamplerOutput(NamedTuple):
    token_ids: jax.Array      # int32[S]
    logprobs: jax.Array       # float32[S], logprob of token_ids under the processed distribution
    top_token_ids: jax.Array  # int32[S, num_top], best first
    top_logprobs: jax.Array   # float32[S, num_top]


# ---- the jitted pieces ----------------------------------------------------------
def _scatter_ids(shape, ids, value, V, dtype):
    """A [S, V] array with ``value`` scattered (added) at each valid id of each row."""
    S = shape[0]
    ids = jnp.where((ids < 0) | (ids >= V), V, ids)  # invalid ids -> the extra column
    rows = jnp.arange(S)[:, None]
    out = jnp.zeros((S, V + 1), dtype).at[rows, ids].add(value)
    return out[:, :V]


def _ban(logits, banned):
    if banned.shape[1] == 0:
        return logits
    S, V = logits.shape
    hit = _scatter_ids((S, V), banned, 1, V, jnp.int32) > 0
    return jnp.where(hit, -jnp.inf, logits)


def _apply_penalties(logits, t: SamplingTensors):
    S, V = logits.shape
    out_counts = _scatter_ids((S, V), t.output_token_ids, 1, V, jnp.int32)
    out_mask = out_counts > 0
    seen = out_mask | (_scatter_ids((S, V), t.prompt_token_ids, 1, V, jnp.int32) > 0)
    rep = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - t.frequency_penalty[:, None] * out_counts.astype(jnp.float32)
    logits = logits - t.presence_penalty[:, None] * out_mask.astype(jnp.float32)
    return logits


def _bisect_max(pred, lo, hi, iters):
    """Per row, the largest uint32 t in [lo, hi] with pred(t) true, for pred
    true at lo and monotone (true, then false). ``iters`` >= bit length of hi - lo."""

    def body(_, c):
        lo, hi = c
        d = hi - lo
        mid = lo + (d >> 1) + (d & 1)
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = lax.fori_loop(0, iters, body, (lo, hi))
    return lo


def _orderable(x):
    """float32 -> uint32 with the same order (-0.0 first mapped to +0.0)."""
    x = jnp.where(x == 0, jnp.zeros_like(x), x)
    b = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _apply_bitmask(logits, bitmask):
    """Structured output: token t stays where bit t % 32 of ``bitmask[:, t // 32]`` is set."""
    S, V = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32], low bit first
    allowed = bits.reshape(S, -1)[:, :V] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _apply_top_k(logits, top_k):
    S, V = logits.shape
    keys = _orderable(logits)
    k = jnp.clip(top_k, 1, V)[:, None]
    # The k-th largest value: the largest t with #(keys >= t) >= k.
    thr = _bisect_max(lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k,
                      keys.min(-1, keepdims=True), keys.max(-1, keepdims=True), 32)
    drop = (keys < thr) & (top_k < V)[:, None]
    return jnp.where(drop, -jnp.inf, logits)


def _apply_top_p(logits, top_p):
    probs = jax.nn.softmax(logits, axis=-1)
    keys = lax.bitcast_convert_type(probs, jnp.uint32)  # probs >= 0: bit order = value order
    q = (1.0 - top_p)[:, None]
    # The largest t with mass(p <= t) <= 1 - top_p; tokens at or below it go.
    # Probabilities are <= 1.0 = 0x3F800000 < 2**30, so 30 halvings suffice.
    mass_le = lambda t: jnp.sum(jnp.where(keys <= t, probs, 0.0), axis=-1, keepdims=True) <= q
    kmax = keys.max(-1, keepdims=True)
    thr = _bisect_max(mass_le, jnp.zeros_like(kmax), kmax, 30)
    drop = (keys <= thr) & (keys < kmax) & (top_p < 1.0)[:, None]
    return jnp.where(drop, -jnp.inf, logits)


def _apply_min_p(logits, min_p):
    rel = jnp.exp(logits - logits.max(-1, keepdims=True))  # p / p_max
    return jnp.where(rel < min_p[:, None], -jnp.inf, logits)


def _last_positive(x):
    """Per row, the index of the last entry > 0 (0 if none)."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax((x > 0)[:, ::-1], axis=-1)


def inverse_cdf(probs, u):
    """Per row, the token where the cumulative probability first exceeds
    ``u * total``; never a zero-probability token (when the row has any mass). The sampler's draw,
    and a draft model's sampled draft in its jitted loop (``executor.decode_loop``)."""
    S, V = probs.shape
    nb = -(-V // _CDF_BLOCK)
    p = jnp.pad(probs, ((0, 0), (0, nb * _CDF_BLOCK - V))).reshape(S, nb, _CDF_BLOCK)
    bsum = p.sum(-1)                                   # [S, nb]
    bcum = jnp.cumsum(bsum, axis=-1)
    x = u * bcum[:, -1]
    b = jnp.sum(bcum <= x[:, None], axis=-1)
    b = jnp.minimum(b, _last_positive(bsum))           # rounding at the top end
    before = jnp.where(b > 0, jnp.take_along_axis(bcum, jnp.maximum(b - 1, 0)[:, None], -1)[:, 0], 0.0)
    x_in = jnp.maximum(x - before, 0.0)
    inner = jnp.take_along_axis(p, b[:, None, None], axis=1)[:, 0]  # [S, block]
    j = jnp.sum(jnp.cumsum(inner, axis=-1) <= x_in[:, None], axis=-1)
    j = jnp.minimum(j, _last_positive(inner))
    return (b * _CDF_BLOCK + j).astype(jnp.int32)


def row_uniforms(key_data, key_offset):
    """float32[S]: each random row's uniform, from its threefry key words and offset (the docstring's
    Randomness); :func:`sample`'s draw, and multi-step decoding's seeded draws in its loop."""
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    draw = lambda k, o: jax.random.uniform(jax.random.fold_in(k, o), (), jnp.float32)
    return jax.vmap(draw)(keys, key_offset)


def _argmax(x, chunk: int = 1024):
    """``jnp.argmax(x, axis=-1)`` as int32: the first maximum, a NaN counting as +inf (so the
    first NaN, as argmax gives, unless a +inf comes before it). In two levels: the first
    chunk holding the maximum, then the place in it; XLA's CPU backend runs the one-level
    index reduction over a 50k vocabulary 5-10x slower."""
    S, V = x.shape

    def key(v):  # XLA's CPU max may drop NaNs; computed inside each reduction, not stored
        return jnp.where(jnp.isnan(v), jnp.inf, v)

    if V <= chunk:
        return jnp.argmax(key(x), axis=-1).astype(jnp.int32)

    n = V // chunk
    maxima = key(x[:, :n * chunk].reshape(S, n, chunk)).max(axis=-1)
    if V % chunk:
        maxima = jnp.concatenate([maxima, key(x[:, n * chunk:]).max(axis=-1, keepdims=True)], axis=1)
    # The chosen chunk (the short last one read from V - chunk: what it shares with the chunk
    # before is below its maximum, or that chunk would have been chosen first).
    start = jnp.minimum(jnp.argmax(maxima, axis=-1) * chunk, V - chunk)
    rows = jax.vmap(lambda r, s: lax.dynamic_slice(r, (s,), (chunk,)))(x, start)
    return (start + jnp.argmax(key(rows), axis=-1)).astype(jnp.int32)


def _top(logprobs, num_top):
    S = logprobs.shape[0]
    if num_top == 0:
        return jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), jnp.float32)
    vals, ids = lax.top_k(logprobs, num_top)
    return ids.astype(jnp.int32), vals


def greedy_tokens(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's argmax (int32[S]) and its plain log_softmax logprob (float32[S]), with no [S, V]
    log_softmax materialised: the sampler's all-greedy path, and what the model step itself returns
    beside its logits (``paged_jax.executor.model_runner.make_step``), so that a step asking nothing
    but argmax needs no sampler call."""
    logits = logits.astype(jnp.float32)
    ids = _argmax(logits)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return ids, jnp.take_along_axis(logits, ids[:, None], -1)[:, 0] - lse


def _masked(logits, t: SamplingTensors):
    """Steps 1-2: banned ids, the grammar mask, penalties."""
    logits = _ban(logits.astype(jnp.float32), t.banned_token_ids)
    if t.token_bitmask.shape[1]:  # static: only steps with a constrained row pay for the mask
        logits = _apply_bitmask(logits, t.token_bitmask)
    if t.do_penalties:
        logits = _apply_penalties(logits, t)
    return logits


def _truncated(logits, t: SamplingTensors):
    """Steps 3-6 (random rows): temperature, top-k, top-p, min-p."""
    logits = logits / t.temperature[:, None]
    if t.do_top_k:
        logits = _apply_top_k(logits, t.top_k)
    if t.do_top_p:
        logits = _apply_top_p(logits, t.top_p)
    if t.do_min_p:
        logits = _apply_min_p(logits, t.min_p)
    return logits


@jax.jit
def sample(logits: jax.Array, t: SamplingTensors) -> SamplerOutput:
    """Sample one token per row. ``logits``: float[S, V] with S == t.batch_size."""
    S, V = logits.shape
    if t.temperature.shape[0] != S:
        raise ValueError(f"logits have {S} rows but the sampling tensors {t.temperature.shape[0]}")
    logits = _masked(logits, t)
    if t.all_greedy:
        if t.num_top == 0:
            return SamplerOutput(*greedy_tokens(logits), *_top(logits[:, :0], 0))
        ids = _argmax(logits)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
    else:
        logits = _truncated(logits, t)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        drawn = inverse_cdf(jnp.exp(logprobs), row_uniforms(t.key_data, t.key_offset))
        ids = jnp.where(t.greedy, _argmax(logits), drawn)
    lp = jnp.take_along_axis(logprobs, ids[:, None], -1)[:, 0]
    return SamplerOutput(ids, lp, *_top(logprobs, t.num_top))


def _processed(logits, t: SamplingTensors):
    """Steps 1-6: a random row's logits as :func:`sample` draws from them (a greedy row's: penalised)."""
    logits = _masked(logits, t)
    return logits if t.all_greedy else _truncated(logits, t)


def processed_logprobs(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """float32[S, V]: the logprobs :func:`sample` draws a random row's token from and reports (its
    processing, then log-softmax); traced inline (the decode loop's draws)."""
    return jax.nn.log_softmax(_processed(logits, t), axis=-1)


@jax.jit
def processed_probs(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """float32[S, V]: the distribution each random row of :func:`sample` draws from (speculative
    decoding's sampled drafts verify with it); a greedy row's is its penalised softmax."""
    return jax.nn.softmax(_processed(logits, t), axis=-1)


@partial(jax.jit, static_argnames=("num_top",))
def token_logprobs(logits: jax.Array, token_ids: jax.Array, num_top: int = 0):
    """Plain log_softmax logprobs of given tokens (for ``prompt_logprobs``): row t
    of ``logits`` [T, V] scores ``token_ids[t]`` (the next prompt token). Returns
    (logprob [T], top ids [T, num_top], top logprobs [T, num_top]). No penalties
    or temperature: the model's own distribution."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logprobs, token_ids[:, None].astype(jnp.int32), -1)[:, 0]
    return (lp, *_top(logprobs, min(num_top, logits.shape[1])))


__all__ = ["PAD_ID", "SamplerOutput", "SamplingTensors", "greedy_tokens", "inverse_cdf", "processed_logprobs", "processed_probs", "row_uniforms", "sample", "seed_for_sample", "token_logprobs"]
