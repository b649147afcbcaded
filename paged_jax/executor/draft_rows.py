"""Speculative decoding's verification rows: how a step's rows with draft tokens become chunks of the
ragged batch (plain Python; the runner builds the batch from them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from paged_jax.executor.batch import SeqChunk

if TYPE_CHECKING:
    from paged_jax.executor.interface import RowSampling
    from paged_jax.scheduler import SchedulerOutput


def verification_chunks(out: SchedulerOutput, sampling: Sequence[RowSampling],
                        drafts_as_rows: bool) -> tuple[list[SeqChunk], list[tuple]]:
    """The step's chunks, and each one's ``(scheduled row, first scored position)``: None for a row
    without drafts, 0 for a row with drafts run as one chunk (a query tile scoring its k + 1 positions).
    With ``drafts_as_rows`` a row with drafts runs each of its tokens as a one-token chunk of its own,
    position j, over the same block table, each attending up to its own position (a step writes every
    token's K/V before attention reads): a step of decodes and drafts keeps a decode step's shape."""
    chunks, owners = [], []
    for i, r in enumerate(out.scheduled):
        tokens = r.seq.get_token_ids()[r.start_pos:r.start_pos + r.num_tokens]
        drafted = bool(sampling[i].num_speculative_tokens)
        if drafted and drafts_as_rows:
            chunks += [SeqChunk([t], r.start_pos + j, r.block_table, r.seq.get_prompt_len())
                       for j, t in enumerate(tokens)]
            owners += [(i, j) for j in range(len(tokens))]
        else:
            chunks.append(SeqChunk(tokens, r.start_pos, r.block_table, r.seq.get_prompt_len()))
            owners.append((i, 0 if drafted else None))
    return chunks, owners
