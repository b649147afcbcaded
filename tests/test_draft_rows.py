"""A verification step's batch (drafts scored as query tiles): one forward pass for any number of
drafted rows, in a shape the warm-up compiled."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.executor.batch import SeqChunk, prepare_batch, warmup_shapes
from paged_jax.executor.draft_rows import verification_tiles


@pytest.mark.parametrize("k", range(1, 8))
def test_a_verification_step_holds_every_drafted_row_as_one_tile(k):
    """Up to 64 rows, each its pending token and k drafts (and decodes and a prompt chunk beside them):
    every drafted row is a tile of its own in one batch whose tile count is the warm-up's for its token
    bucket (not a shape of its own, nor two steps)."""
    block_size = 16
    warm = {key[0]: key[3] for key in warmup_shapes(64, 1024, 256, block_size) if key[3]}
    for drafted in (1, 4, 5, 6, 7, 16, 33, 64):
        for prompt in (0, 40):
            chunks = [SeqChunk(list(range(1, k + 2)), 10 + r, list(range(r * 8, r * 8 + 8))) for r in range(drafted)]
            chunks += [SeqChunk([3], 20, [600, 601])]  # a decode
            if prompt:
                chunks.append(SeqChunk(list(range(1, prompt + 1)), 0, [700, 701, 702]))
            batch = prepare_batch(chunks, block_size, capacity=verification_tiles)
            T, _, _, N = batch.shape_key
            assert N == verification_tiles(T) and T in warm, (drafted, prompt, T, N)
            real = np.asarray(batch.tile_query_lens)[np.asarray(batch.tile_seq) < len(chunks)]
            assert sorted(real.tolist()) == sorted([k + 1] * drafted + ([prompt] if prompt else []))
