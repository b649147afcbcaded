"""Speculative decoding's verification rows: how a step's rows with draft tokens become chunks of the
ragged batch (plain Python; the runner builds the batch from them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from paged_jax.attention.metadata import TILE_SIZE
from paged_jax.executor.batch import SeqChunk, tile_capacity

if TYPE_CHECKING:
    from paged_jax.executor.interface import RowSampling
    from paged_jax.scheduler import SchedulerOutput


def drafts_as_rows(backend) -> bool:
    """Whether steps on attention ``backend`` run a row's pending token and drafts as a decode row per
    token (:func:`verification_chunks`), rather than as one query tile: unless the backend declares
    ``verifies_in_tiles`` (its tiles cost their real queries: native, Pallas). The jnp reference pads
    a tile to 256 queries, and a tile of 5 tokens cost it 10-20x a decode step against 2-4x for the
    rows (README, Speculative decoding)."""
    return not getattr(backend, "verifies_in_tiles", False)


def verification_tiles(num_tokens_bucket: int, tile_size: int = TILE_SIZE) -> int:
    """Query tiles of a step whose drafts run as tiles: room for every chunk of the step to have its
    own (a chunk of n >= 2 tokens needs ceil(n / tile_size) <= n / 2 of them, so half the token bucket
    holds any step's), so that a verification step is one forward pass whatever its number of drafted
    rows (a prefill step's :func:`~paged_jax.executor.batch.tile_capacity`, at least 4, had split 5 or
    more drafted rows into two). Only the tiles' metadata grows: native ignores them, and Pallas skips
    a tile's padded queries."""
    return max(tile_capacity(num_tokens_bucket, tile_size), num_tokens_bucket // 2)


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
