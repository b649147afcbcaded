"""Multi-step decoding: several decode steps per engine step, in one jitted call (plain Python, no JAX).

At small batches a decode step's host work (scheduling, the batch built in numpy, the engine's output
processing, detokenization and stop checks) costs about as much as the device's step. With
``num_scheduler_steps = k > 1`` (vLLM's name for it) an engine step whose rows are all decodes runs k
one-token steps on the device in one call (``paged_jax.executor.decode_loop``), each step's token the
next one's input, and the engine's host work is paid once for k tokens.

When it applies (:meth:`MultiStepDecoder.plan`): the scheduler gave the step decodes only (every row
runs its one pending token and samples it; no prompt chunk, so nothing waiting could be admitted now),
no cache operation is due, and every row asks for one token and at most its own logprob
(``loop_decodable``): a greedy row the plain argmax (no penalties, no banned ids), a random row a draw
(temperature, top-k, top-p, min-p, ``min_tokens``, seeds), neither with penalties, top logprobs, a
grammar or beam search. Otherwise the step runs as usual. A request that arrives meanwhile is scheduled by the next engine step, after the k tokens; one
that waits for a free sequence slot or blocks waits up to k - 1 tokens longer when a row stops inside
a loop.

Each row decodes ``n = min(k, tokens before max_tokens, room before max_model_len)`` tokens. Its
slots for the ``n - 1`` tokens after the pending one are appended before the call (placeholder
tokens in its sequence, as speculative decoding's drafts: copy-on-write as usual, fewer when the free
blocks run out). After the call (:meth:`MultiStepDecoder.apply`) the placeholders leave, the tokens
are appended one at a time with the engine's stop checks; tokens past a stop are dropped, and the
stopped sequence's blocks (their slots too) are freed with it.

Why the outputs are one-step decoding's: a greedy token is the model's argmax given the tokens before
it, and the loop runs the same step function on exactly those tokens at the same positions. A random
row's token is drawn from the sampler's processed distribution (``processed_logprobs``) by the
sampler's inverse CDF: a seeded row at the sampler's own uniform (its
key at the output's length), so the same token; an unseeded row at a uniform of the runner's own
generator, so a draw from the same distribution. (The loop's block tables may be wider than a one-step
batch's, so the attention may sum over another padded length: a near-tie between two logits, or a
uniform at a token's edge of the CDF, can then go either way, as with another batch size.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from paged_jax.executor.interface import RowSampling, Sample
    from paged_jax.memory.block_manager import BlockManager
    from paged_jax.scheduler import SchedulerOutput
    from paged_jax.sequence import Sequence


def check_num_scheduler_steps(k, speculative_config=None, target_itl_ms=None) -> int:
    """``k`` if it is a valid ``num_scheduler_steps`` beside these options, else ValueError."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_scheduler_steps must be an integer >= 1 (1: one decode step per engine step), got {k!r}")
    if k > 1 and speculative_config is not None:
        raise ValueError(f"num_scheduler_steps={k} is not supported with speculative decoding (speculative_config): "
                         f"its steps verify drafts; use one or the other")
    if k > 1 and target_itl_ms is not None:
        raise ValueError(f"num_scheduler_steps={k} is not supported with a latency target (target_itl_ms): a step "
                         f"of several tokens would be the gap between a stream's tokens; use one or the other")
    return k


def check_multi_step(executor) -> None:
    """ValueError unless ``executor`` runs decode loops (the model runner on one device, one layer group)."""
    if getattr(executor, "decode_loops", None) is None:
        raise ValueError("num_scheduler_steps > 1 needs the model on one device (no tensor parallelism) and its KV "
                         "cache in one layer group (a model with sliding-window layers runs with "
                         "free_blocks_outside_window=False)")


class MultiStepDecoder:
    """Plans the multi-step engine steps and applies their tokens (see the module docstring). ``num_steps``
    (> 1) is checked by :func:`check_num_scheduler_steps` where the engine takes it."""

    def __init__(self, num_steps: int, block_manager: "BlockManager", max_model_len: int,
                 eos_token_id: Optional[int]) -> None:
        self.num_steps = num_steps
        self.block_manager, self.max_model_len, self.eos_token_id = block_manager, max_model_len, eos_token_id
        self.num_multi_steps = 0  # engine steps that ran several decode steps
        self.num_tokens = 0  # tokens those steps decoded (before stops dropped any)

    def plan(self, out: "SchedulerOutput", sampling: Seq["RowSampling"]) -> Optional[list[int]]:
        """How many tokens each row of ``out`` decodes in this step, their slots appended to the rows'
        sequences and tables; None when the step runs as usual (one token a row)."""
        from paged_jax.sampling_tensors import loop_decodable  # here: the engine's modules import no JAX

        if not out.scheduled or out.blocks_to_swap_in or out.blocks_to_swap_out or out.blocks_to_copy:
            return None
        limits = []
        for row, spec in zip(out.scheduled, sampling):
            seq, p = row.seq, spec.params
            if not (row.num_tokens == 1 and row.completes and len(spec.seeds) == 1 and seq.get_output_len() > 0
                    and row.group.beam is None and seq.matcher is None and not spec.num_candidates
                    and not spec.return_probs and spec.prompt_logprobs is None and not spec.num_speculative_tokens
                    and loop_decodable(p, seq.get_output_len(), self.eos_token_id)):
                return None
            n = min(self.num_steps, self.max_model_len - seq.get_len())
            if p.max_tokens is not None:
                n = min(n, p.max_tokens - seq.get_output_len())
            limits.append(max(n, 1))
        if max(limits) == 1:
            return None
        for i, row in enumerate(out.scheduled):
            limits[i] = 1 + self._grow(row, limits[i] - 1, out)
        if max(limits) == 1:  # no free block for a second token: one step as usual
            return None
        self.num_multi_steps += 1
        self.num_tokens += sum(limits)
        return limits

    def _grow(self, row, most: int, out: "SchedulerOutput") -> int:
        """Append up to ``most`` placeholder tokens and their slots to the row's sequence and table (as
        many as the free blocks cover); returns how many."""
        seq, bm, n = row.seq, self.block_manager, 0
        while n < most:
            seq.output_token_ids.append(0)
            if not bm.can_append_slots(row.group):
                seq.output_token_ids.pop()
                break
            copy = bm.append_slot(seq)
            if copy is not None:  # the scheduler's append_slot already owns the last block; kept for safety
                out.blocks_to_copy.append(copy)
            n += 1
        if n:
            row.block_table = bm.get_block_table(seq)
        return n

    def apply(self, seq: "Sequence", samples: list["Sample"], append: Callable[["Sample"], None]) -> None:
        """A multi-step row after the step (``seq.num_computed_tokens`` counting its pending token): the
        placeholders leave, ``append`` (the engine's: the token, detokenization, the stop checks) takes
        each sample until the sequence finishes. A row that keeps fewer than its samples has finished (a
        stop, or a failure that aborted it): the engine frees its blocks whole, dropped slots included."""
        extra = len(samples) - 1
        if extra:
            del seq.output_token_ids[len(seq.output_token_ids) - extra:]
        computed = seq.num_computed_tokens + extra  # the loop wrote the K/V of every sample but the last
        for sample in samples:
            append(sample)
            if seq.is_finished():
                break
        seq.num_computed_tokens = min(computed, seq.get_len() - 1)  # never past its own tokens

    def get_stats(self) -> dict:
        return {"num_scheduler_steps": self.num_steps, "num_multi_steps": self.num_multi_steps,
                "num_multi_step_tokens": self.num_tokens}
