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
:func:`~paged_jax.sampler.processed_probs`: penalties over the output so far and the drafts before,
``min_tokens``' banned ids, temperature, top-k, top-p, min-p), by the sampler's inverse CDF at a
uniform drawn beforehand on the host (``paged_jax.spec_decode.sampled.position_rng``: the uniform a
draft drawn one step at a time takes, so a seeded row draws the same drafts either way); the loop
returns every step's ``q`` for the rejection sampler.
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
from paged_jax.sampler import greedy_tokens, inverse_cdf, processed_probs
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


jax.tree_util.register_dataclass(LoopDraws, data_fields=[f.name for f in dataclasses.fields(LoopDraws)],
                                 meta_fields=[])


def make_decode_loop(step, block_size: int, num_steps: int, vocab_size: int):
    """``loop(params, kv_caches, batch, limits, draws=None) -> (tokens int32[num_steps, S], logprobs, q, kv_caches)``
    jitted, for ``step`` the runner's step function (:func:`paged_jax.executor.model_runner.make_step`;
    the draft model's takes its runner's ``param_leaves`` as ``params``, ``on_param_leaves``):
    step j runs row s's token at ``batch.positions[s] + j`` (its first token from ``batch.input_ids``,
    then the draft of the step before) while ``j < limits[s]``; the loop stops after ``max(limits)``
    steps (the outputs of later steps are zeros). ``draws`` (:class:`LoopDraws`): the
    sampled rows' draws; ``logprobs`` float32[num_steps, S] each argmax's logprob (a drawn token's: its
    argmax's); ``q`` float32[num_steps, S, V] the distributions they were drawn from (None without
    ``draws``)."""

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
                ids, q, history = _draw(step_out.logits, draws, j, history, ids)
                qs = qs.at[j].set(q)
            return kv, ids, out.at[j].set(ids), lps.at[j].set(lp), history, qs

        out = jnp.zeros((num_steps, S), jnp.int32)
        lps = jnp.zeros((num_steps, S), jnp.float32)
        history = qs = None
        if draws is not None:
            history = draws.tensors.output_token_ids
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
    q = processed_probs(logits, dataclasses.replace(t, output_token_ids=history, banned_token_ids=banned))
    ids = jnp.where(draws.sampled, inverse_cdf(q, draws.uniforms[j]), argmax)
    if history.shape[1]:  # static: only with penalties is the history kept
        history = history.at[jnp.arange(history.shape[0]), num_output].set(ids)
    return ids, q, history


def loop_draws(rows: Sequence[tuple], num_rows: int, num_steps: int, vocab_size: int, uniforms: np.ndarray) -> LoopDraws:
    """The draws of a loop over ``num_rows`` batch rows (padded) and ``num_steps`` steps. ``rows``: each
    real row's ``(params, seed, prompt_token_ids, history)``, params None for a greedy row (the argmax);
    ``history``: its output tokens before step 0's draft. ``uniforms`` float[num_steps, len(rows)]."""
    from paged_jax.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0)
    # The banned ids of every row as if at its first token (min_tokens' ban, lifted in the loop) and no
    # history: the loop's own, with room for the drafts, replaces it where penalties need it.
    tensors = SamplingTensors.from_params([(p or greedy, s, prompt, ()) for p, s, prompt, _ in rows], vocab_size,
                                          pad_to=num_rows, num_top=0)
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
    return LoopDraws(dataclasses.replace(tensors, output_token_ids=history), u, sampled, history_len, banned_until)


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
        self._loops: dict[int, Any] = {}  # num_steps -> the jitted loop
        self.compiled: dict[tuple, Any] = {}  # (num_steps, loop_key) -> the compiled loop

    def compiled_loop(self, num_steps: int, params, kv_caches, batch, limits, draws: Optional[LoopDraws] = None):
        """The loop of ``num_steps`` steps compiled for these arguments (abstract or concrete)."""
        key = (num_steps, loop_key(batch, draws))
        if key not in self.compiled:
            if num_steps not in self._loops:
                self._loops[num_steps] = make_decode_loop(self.step, self.block_size, num_steps, self.vocab_size)
            self.compiled[key] = self._loops[num_steps].lower(params, kv_caches, batch, limits, draws).compile()
        return self.compiled[key]

    def warm_up(self, num_steps: int, params, kv_caches, max_rows: int, max_model_len: int,
                draws_for: Callable[[int], list] = lambda rows: [None]) -> None:
        """Compile the loop for every decode step shape of up to ``max_rows`` rows, with each of
        ``draws_for(rows)`` (default: greedy only)."""
        from paged_jax.executor.batch import Batch, warmup_shapes

        for key in warmup_shapes(max_rows, 1, max_model_len, self.block_size):
            if not key[3]:  # decode shapes: no prefill tiles
                limits = jax.ShapeDtypeStruct((key[1],), np.int32)
                for draws in draws_for(key[1]):
                    self.compiled_loop(num_steps, params, kv_caches, Batch.abstract(key), limits, draws)

    def run(self, num_steps: int, params, kv_caches, tokens: list[int], positions: list[int],
            tables: list[list[int]], limits: list[int]):
        """Rows ``s``: ``tokens[s]`` at ``positions[s]``, then its argmax, for ``num_steps`` steps, the first
        ``limits[s]`` kept (``tables[s]`` covers their slots). Returns (ids int32[num_steps, rows], their
        logprobs, kv_caches), the ids and logprobs in numpy."""
        batch, padded = loop_batch(tokens, positions, tables, limits, self.block_size)
        loop = self.compiled_loop(num_steps, params, kv_caches, batch, padded)
        ids, logprobs, _, kv_caches = loop(params, kv_caches, batch, padded, None)
        return np.asarray(ids), np.asarray(logprobs), kv_caches


def loop_key(batch, draws: Optional[LoopDraws]) -> tuple:
    """What a call of the loop compiles for: the batch's shape, and the draws' structure (the sampler's
    static flags) and shapes."""
    if draws is None:
        return batch.shape_key, None
    leaves, treedef = jax.tree.flatten(draws)
    return batch.shape_key, treedef, tuple(x.shape for x in leaves)
