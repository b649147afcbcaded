"""The next decode step dispatched before this one's tokens are read (vLLM's async scheduling, done
inside the executor).

At batch 1-4 a decode step's host work (scheduling, collecting the tokens, the engine's output
processing, detokenization, stop checks) ran while the device waited: about 0.5 ms a token on the
benchmark CPU, as much as an int4 model's whole jitted step. When a step is a pure decode step whose
every sample is the step's own argmax (``paged_jax.executor.sampling``), the step after it is known
but for its tokens: each row one position further (position, context length and rotary length one
more, its K/V slot the next of the same block) and its input token the argmax this step computes.
So the runner dispatches that step at once, its input ids the device array of this step's argmax,
and the device runs it while the host reads this step's tokens, processes them and schedules.

The next :meth:`ModelRunner.execute` takes that step's outputs only if the scheduler asked for
exactly that step: the batch it prepares equals the one run ahead, array for array (the same
sequences in the same rows and blocks, each one token on, that token the argmax read back), with
no cache operations and nothing but each row's last logits wanted. Otherwise it is dropped and the
step runs as usual; then the only trace of it is the K/V it wrote for each row's next position, in
a block the sequence held alone (the next position is in the block the step wrote, never a new one,
and shared blocks are full ones): the real step writes that slot again, and a block freed meanwhile
(a request that stopped or was preempted) is rewritten by its next owner before anything reads it,
device steps running in order. Results are what they are without it, bitwise: a step taken is the
same program on the same inputs (padded rows' argmax is 0, as their input ids are).

Not run ahead: with several devices (tensor parallelism), several layer groups, when a row's next
position starts a new block, when a row takes its last token (``max_tokens``), or when the runner's
``run_ahead`` is off (the engine turns it off with speculative decoding, whose next step is a
verification, and with a latency target, whose cost model learns from measured step times: steps run
ahead would hide the device's time, and a dropped one would add a step to the next).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import numpy as np

from paged_jax.executor.batch import Batch
from paged_jax.executor.interface import RowSampling
from paged_jax.scheduler import SchedulerOutput


class AheadStep(NamedTuple):
    """A decode step dispatched ahead: its batch with input ids still on the device (the previous
    step's argmax, ``ids``), and its outputs (a ``StepOutput``, possibly not computed yet)."""

    batch: Batch
    ids: object  # int32[rows] on the device: the previous step's argmax, this step's input ids
    step_out: object


def next_decode_batch(batch: Batch, out: SchedulerOutput, sampling: Sequence[RowSampling], block_size: int,
                      next_ids) -> Optional[Batch]:
    """The decode step after ``batch`` (a decode step of one layer group whose rows are ``out.scheduled``,
    each sampling once, the argmax ``next_ids``), or None when it cannot be known now: a row's next
    position starts a new block, or the row takes its last token now."""
    if batch.num_tiles or batch.input_ids.shape[0] != batch.block_tables.shape[0] or len(out.scheduled) == 0:
        return None
    for row, spec in zip(out.scheduled, sampling):
        seq, p = row.seq, spec.params
        if len(spec.seeds) != 1 or (row.start_pos + 1) % block_size == 0:
            return None
        if p.max_tokens is not None and seq.get_output_len() + 1 >= p.max_tokens:
            return None
    real = batch.query_lens > 0
    step = real.astype(np.int32)
    positions = batch.positions + step
    return dataclasses.replace(batch, input_ids=next_ids, positions=positions,
                               rope_lengths=np.where(real, np.maximum(batch.rope_lengths, positions + 1), 0),
                               slot_mapping=batch.slot_mapping + step, context_lens=batch.context_lens + step)


def same_step(ahead: AheadStep, batch: Batch) -> bool:
    """Whether ``batch`` (prepared for this step, numpy) is the step run ahead: every array equal, the
    input ids to the argmax the ahead step took (read back now; the previous step is done)."""
    if batch.shape_key != ahead.batch.shape_key:
        return False
    for f in dataclasses.fields(Batch):
        mine, theirs = getattr(batch, f.name), getattr(ahead.batch, f.name)
        if f.name == "input_ids":
            theirs = np.asarray(ahead.ids)
        if f.metadata.get("static"):
            if mine != theirs:
                return False
        elif mine is None or theirs is None:
            if mine is not theirs:
                return False
        elif not _same_bits(mine, theirs):
            return False
    return True


def _same_bits(a, b) -> bool:
    """Whether two arrays hold the same bytes in the same shape and dtype: the same inputs to the step,
    bit for bit (np.array_equal on each of a batch's arrays took 35 us of a 0.6-ms int4 step)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
