"""Several decode steps of a model in one jitted call: ``k`` one-token steps in a ``lax.fori_loop``.

Two users: a draft model's drafts (``paged_jax.spec_decode.draft_model``) and the target model's own
multi-step decoding (``paged_jax.multi_step``). Decoding one token at a time through
``ModelRunner.execute`` costs a dispatch, a batch built in numpy, a wait and the engine's own step per
token; on a small model that overhead is most of a token's cost (README, Speculative decoding;
Multi-step decoding). Here the decode batch of the first drafts is built once, with block tables
already covering every draft's slot, and the loop feeds each step's draft to the next: position,
slot and context length advance by one a step, and a row past its own number of drafts writes its
K/V to the null block (its tokens are ignored).

A greedy row's token is the step's argmax (with its logprob). A sampled row's (:class:`LoopDraws`) is
drawn on the device from ``q``, the step's distribution after the request's processing (the sampler's own
:func:`~paged_jax.sampler.processed_logprobs`: penalties over the output so far and the tokens before,
``min_tokens``' banned ids, temperature, top-k, top-p, min-p), by the sampler's inverse CDF at a
uniform: for a draft, one drawn beforehand on the host (``paged_jax.spec_decode.sampled.position_rng``:
the uniform a draft drawn one step at a time takes, so a seeded row draws the same drafts either way),
and the loop returns every step's ``q`` for the rejection sampler; for multi-step decoding's seeded
rows, the sampler's own (its key at the row's output length), so the tokens are one-step decoding's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from paged_jax.executor.batch import SeqChunk, bucket, prepare_batch
from paged_jax.memory.block_allocator import NULL_BLOCK
from paged_jax.sampler import greedy_tokens, inverse_cdf, processed_logprobs, row_uniforms
from paged_jax.sampling_tensors import PAD_ID, SamplingTensors
from paged_jax.utils import pow2_bucket

if TYPE_CHECKING:
    from paged_jax.executor.batch import Batch


@dataclasses.dataclass(frozen=True)
class LoopDraws:
    """What the loop needs to draw its sampled rows' drafts (a pytree; build with :func:`loop_draws`).
    S: the batch's rows, N: the loop's steps."""

    tensors: SamplingTensors  # each row's processing; output_token_ids holds its history with room for N drafts
    uniforms: Any  # float32[N, S]: the uniform of step j's draw
    sampled: Any  # bool[S]: rows that draw (the others take the argmax)
    history_len: Any  # int32[S]: output tokens before step 0's draft (step j's draft is output token history_len + j)
    banned_until: Any  # int32[S]: min_tokens: the banned ids apply while the output is shorter
    keyed: Any  # bool[S]: rows drawing at the sampler's own seeded uniform (row_uniforms at offset + j), not uniforms'


jax.tree_util.register_dataclass(LoopDraws, data_fields=[f.name for f in dataclasses.fields(LoopDraws)],
                                 meta_fields=[])


def make_decode_loop(step, block_size: int, num_steps: int, vocab_size: int, return_q: bool = True):
    """``loop(params, kv_caches, batch, limits, draws=None) -> (tokens int32[num_steps, S], logprobs, q, kv_caches)``
    jitted, for ``step`` the runner's step function (:func:`paged_jax.executor.model_runner.make_step`;
    the draft model's takes its runner's ``param_leaves`` as ``params``, ``on_param_leaves``):
    step j runs row s's token at ``batch.positions[s] + j`` (its first token from ``batch.input_ids``,
    then the draft of the step before) while ``j < limits[s]``; the loop stops after ``max(limits)``
    steps (the outputs of later steps are zeros). ``draws`` (:class:`LoopDraws`): the
    sampled rows' draws; ``logprobs`` float32[num_steps, S] each token's logprob (a greedy row's under the
    raw logits, a drawn token's under q, as the sampler reports them); ``q`` float32[num_steps, S, V] the
    distributions they were drawn from (None without ``draws`` or ``return_q``)."""

    def loop(params, kv_caches, batch: "Batch", limits, draws: Optional[LoopDraws] = None):
        live_rows = batch.query_lens > 0
        S = batch.block_tables.shape[0]

        def body(j, carry):
            kv, tokens, out, lps, history, qs = carry
            pos = batch.positions + j
            block = jnp.take_along_axis(batch.block_tables, (pos // block_size)[:, None], axis=1)[:, 0]
            slot = jnp.where(j < limits, block * block_size + pos % block_size, NULL_BLOCK * block_size)
            b = dataclasses.replace(batch, input_ids=tokens, positions=pos, rope_lengths=pos + 1, slot_mapping=slot,
                                    context_lens=jnp.where(live_rows, pos + 1, 0))
            step_out, kv = step(params, kv, b, False)
            # The step leaves greedy ids out past GREEDY_IN_STEP_MAX_LOGITS (many rows, a large vocabulary).
            if step_out.greedy_ids is not None:
                ids, lp = step_out.greedy_ids, step_out.greedy_logprobs
            else:
                ids, lp = greedy_tokens(step_out.logits)
            if draws is not None:
                ids, drawn_lp, q, history = _draw(step_out.logits, draws, j, history, ids)
                lp = jnp.where(draws.sampled, drawn_lp, lp)
                if qs is not None:
                    qs = qs.at[j].set(q)
            return kv, ids, out.at[j].set(ids), lps.at[j].set(lp), history, qs

        out = jnp.zeros((num_steps, S), jnp.int32)
        lps = jnp.zeros((num_steps, S), jnp.float32)
        history = qs = None
        if draws is not None:
            history = draws.tensors.output_token_ids
            if return_q:
                qs = jnp.zeros((num_steps, S, vocab_size), jnp.float32)
        # As many steps as the longest row keeps (rows past their limit would only write the null block).
        steps = jnp.minimum(num_steps, jnp.max(limits))
        kv_caches, _, out, lps, _, qs = lax.fori_loop(0, steps, body, (kv_caches, batch.input_ids, out, lps, history, qs))
        return out, lps, qs, kv_caches

    return jax.jit(loop, donate_argnums=(1,))


def _draw(logits, draws: LoopDraws, j, history, argmax):
    """Step ``j``'s drafts: each sampled row's drawn from its processed distribution q at its uniform,
    the argmax elsewhere; q; and the history with the drafts recorded (penalties count them)."""
    t = draws.tensors
    num_output = draws.history_len + j
    banned = jnp.where((num_output < draws.banned_until)[:, None], t.banned_token_ids, PAD_ID)
    # As the sampler draws and reports: q = exp(logprobs), the token at the uniform's inverse CDF.
    logprobs = processed_logprobs(logits, dataclasses.replace(t, output_token_ids=history, banned_token_ids=banned))
    q = jnp.exp(logprobs)
    u = jnp.where(draws.keyed, row_uniforms(t.key_data, t.key_offset + j.astype(jnp.uint32)), draws.uniforms[j])
    ids = jnp.where(draws.sampled, inverse_cdf(q, u), argmax)
    if history.shape[1]:  # static: only with penalties is the history kept
        history = history.at[jnp.arange(history.shape[0]), num_output].set(ids)
    return ids, jnp.take_along_axis(logprobs, ids[:, None], -1)[:, 0], q, history


def loop_draws(rows: Sequence[tuple], num_rows: int, num_steps: int, vocab_size: int, uniforms: np.ndarray,
               keyed: Sequence[bool] = (), eos_token_id: Optional[int] = None) -> LoopDraws:
    """The draws of a loop over ``num_rows`` batch rows (padded) and ``num_steps`` steps. ``rows``: each
    real row's ``(params, seed, prompt_token_ids, history)``, params None for a greedy row (the argmax);
    ``history``: its output tokens before step 0's draft. ``uniforms`` float[num_steps, len(rows)];
    ``keyed[r]``: row r (seeded) draws at the sampler's own uniforms instead, its seed's key at offset
    ``len(history) + j`` (the token one-step decoding would draw). ``eos_token_id``: banned with the
    stop ids while ``min_tokens`` is not reached (as the sampler bans it)."""
    from paged_jax.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0)
    # The banned ids of every row as if at its first token (min_tokens' ban, lifted in the loop: the
    # width stays the request's own) and no history: the loop's own, with room for the drafts, replaces
    # it where penalties need it.
    tensors = SamplingTensors.from_params([(p or greedy, s, prompt, ()) for p, s, prompt, _ in rows], vocab_size,
                                          pad_to=num_rows, num_top=0, eos_token_id=eos_token_id)
    history_len = np.zeros(num_rows, np.int32)
    history_len[:len(rows)] = [len(h) for *_, h in rows]
    width = pow2_bucket(int(history_len.max()) + num_steps, 16) if tensors.do_penalties else 0
    history = np.full((num_rows, width), PAD_ID, np.int32)
    banned_until = np.zeros(num_rows, np.int32)
    sampled = np.zeros(num_rows, bool)
    for r, (p, _, _, h) in enumerate(rows):
        if p is not None:
            sampled[r], banned_until[r] = True, p.min_tokens
            if width:
                history[r, :len(h)] = h
    u = np.zeros((num_steps, num_rows), np.float32)
    u[:, :len(rows)] = uniforms
    keyed_rows = np.zeros(num_rows, bool)
    keyed_rows[:len(keyed)] = keyed
    # A seeded row's key at its output's length (from_params saw none), as the sampler keys it.
    key_offset = np.where(keyed_rows, history_len.astype(np.uint32), tensors.key_offset)
    return LoopDraws(dataclasses.replace(tensors, output_token_ids=history, key_offset=key_offset), u, sampled,
                     history_len, banned_until, keyed_rows)


def loop_batch(tokens: list[int], positions: list[int], tables: list[list[int]], limits: list[int],
               block_size: int) -> tuple["Batch", np.ndarray]:
    """The loop's first decode batch (row s: ``tokens[s]`` at ``positions[s]``) with block tables wide
    enough for every draft slot, and the padded ``limits``."""
    chunks = [SeqChunk([t], p, table) for t, p, table in zip(tokens, positions, tables)]
    batch = prepare_batch(chunks, block_size)
    S = batch.block_tables.shape[0]
    width = bucket(max(-(-(p + n) // block_size) for p, n in zip(positions, limits)), batch.block_tables.shape[1])
    block_tables = np.full((S, width), NULL_BLOCK, np.int32)
    for s, table in enumerate(tables):
        block_tables[s, :len(table)] = table[:width]
    padded = np.zeros(S, np.int32)
    padded[:len(limits)] = limits
    return dataclasses.replace(batch, block_tables=block_tables), padded


class DecodeLoops:
    """A runner's decode loops: ``num_steps`` one-token steps of its model, compiled once per batch shape
    and draws' structure (by :meth:`warm_up` or on first use). Its runner's multi-step decoding
    (``paged_jax.multi_step``, greedy, :meth:`run`) and a draft model's drafts (``num_steps`` k + 1, greedy
    and drawn, :meth:`compiled_loop`) take them."""

    def __init__(self, step, block_size: int, vocab_size: int) -> None:
        self.step, self.block_size, self.vocab_size = step, block_size, vocab_size
        self._loops: dict[tuple, Any] = {}  # (num_steps, return_q) -> the jitted loop
        self.compiled: dict[tuple, Any] = {}  # (num_steps, return_q, loop_key) -> the compiled loop

    def compiled_loop(self, num_steps: int, params, kv_caches, batch, limits, draws: Optional[LoopDraws] = None,
                      return_q: bool = True):
        """The loop of ``num_steps`` steps compiled for these arguments (abstract or concrete)."""
        key = (num_steps, return_q, loop_key(batch, draws))
        if key not in self.compiled:
            if (num_steps, return_q) not in self._loops:
                self._loops[num_steps, return_q] = make_decode_loop(self.step, self.block_size, num_steps,
                                                                    self.vocab_size, return_q)
            self.compiled[key] = self._loops[num_steps, return_q].lower(params, kv_caches, batch, limits,
                                                                        draws).compile()
        return self.compiled[key]

    def warm_up(self, num_steps: int, params, kv_caches, max_rows: int, max_model_len: int,
                draws_for: Callable[[int], list] = lambda rows: [None], return_q: bool = True) -> None:
        """Compile the loop for every decode step shape of up to ``max_rows`` rows, with each of
        ``draws_for(rows)`` (default: greedy only)."""
        from paged_jax.executor.batch import Batch, warmup_shapes

        for key in warmup_shapes(max_rows, 1, max_model_len, self.block_size):
            if not key[3]:  # decode shapes: no prefill tiles
                limits = jax.ShapeDtypeStruct((key[1],), np.int32)
                for draws in draws_for(key[1]):
                    self.compiled_loop(num_steps, params, kv_caches, Batch.abstract(key), limits, draws, return_q)

    def run(self, num_steps: int, params, kv_caches, tokens: list[int], positions: list[int],
            tables: list[list[int]], limits: list[int], draws_for: Callable[[int], Optional[LoopDraws]] = lambda S: None):
        """Rows ``s``: ``tokens[s]`` at ``positions[s]``, then its argmax (or its draw: ``draws_for(S)``, the
        draws of the padded batch's S rows), for ``num_steps`` steps, the first ``limits[s]`` kept
        (``tables[s]`` covers their slots). Returns (ids int32[num_steps, rows], their logprobs,
        kv_caches), the ids and logprobs in numpy."""
        batch, padded = loop_batch(tokens, positions, tables, limits, self.block_size)
        draws = draws_for(batch.block_tables.shape[0])
        loop = self.compiled_loop(num_steps, params, kv_caches, batch, padded, draws, return_q=False)
        ids, logprobs, _, kv_caches = loop(params, kv_caches, batch, padded, draws)
        return np.asarray(ids), np.asarray(logprobs), kv_caches


def sampled_draws_for(sampling_params, num_steps: int, vocab_size: int, keyed: bool) -> Callable[[int], list]:
    """For warm-up: ``rows`` -> the draws to compile a loop of that many rows for: greedy (None), and
    drawing with each sampled one of ``sampling_params`` (one or a list; their processing is the loop's
    static part). ``keyed``: the seeded rows draw at the sampler's own uniforms (multi-step decoding)."""
    from paged_jax.sampling_tensors import is_greedy
    from paged_jax.seeds import seed_for_sample

    plist = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params]
    plist = [p for p in plist if p is not None and not is_greedy(p)]

    def draws_for(rows: int) -> list:
        return [None] + [loop_draws([(p, None if p.seed is None else seed_for_sample(p.seed, 0), [0], [0])] * rows,
                                    rows, num_steps, vocab_size, np.zeros((num_steps, rows)),
                                    keyed=[keyed and p.seed is not None] * rows)
                         for p in plist]

    return draws_for


def loop_key(batch, draws: Optional[LoopDraws]) -> tuple:
    """What a call of the loop compiles for: the batch's shape, and the draws' structure (the sampler's
    static flags) and shapes."""
    if draws is None:
        return batch.shape_key, None
    leaves, treedef = jax.tree.flatten(draws)
    return batch.shape_key, treedef, tuple(x.shape for x in leaves)


def multi_step_draws(rows, sampling, limits: Sequence[int], num_steps: int, num_rows: int, vocab_size: int,
                     eos_token_id: Optional[int], rng: np.random.Generator) -> Optional[LoopDraws]:
    """The draws of a multi-step call's random rows (``ModelRunner.execute_steps``; None: every row
    greedy): ``rows`` the step's scheduled rows, ``sampling`` their ``RowSampling``, ``limits`` their
    tokens. A row's history is its output before the loop's first token (its ``limits - 1``
    placeholders left out); a seeded row draws at the sampler's own uniforms, an unseeded one at
    uniforms of ``rng``."""
    from paged_jax.sampling_tensors import is_greedy

    random = [not is_greedy(spec.params) for spec in sampling]
    if not any(random):
        return None
    specs, uniforms = [], np.zeros((num_steps, len(rows)))
    for b, (row, spec, n, r) in enumerate(zip(rows, sampling, limits, random)):
        seq = row.seq
        history = seq.output_token_ids[:len(seq.output_token_ids) - (n - 1)]
        specs.append((spec.params, spec.seeds[0], seq.prompt_token_ids, history) if r else (None, None, (), ()))
        if r and spec.seeds[0] is None:
            uniforms[:, b] = rng.random(num_steps, dtype=np.float32)  # in [0, 1), as float32
    keyed = [r and spec.seeds[0] is not None for r, spec in zip(random, sampling)]
    return loop_draws(specs, num_rows, num_steps, vocab_size, uniforms, keyed, eos_token_id)
