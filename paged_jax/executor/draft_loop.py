"""A draft model's greedy drafts in one jitted call: ``k`` one-token steps in a ``lax.fori_loop``.

Drafting one token at a time through ``ModelRunner.execute`` costs a dispatch, a batch built in numpy
and a wait per draft; on a small draft model that overhead is most of a draft's cost (README,
Speculative decoding). Here the decode batch of the first drafts is built once, with block tables
already covering every draft's slot, and the loop feeds each step's argmax to the next: position,
slot and context length advance by one a step, and a row past its own number of drafts writes its
K/V to the null block (its tokens are ignored).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from paged_jax.executor.batch import SeqChunk, bucket, prepare_batch
from paged_jax.memory.block_allocator import NULL_BLOCK
from paged_jax.sampler import greedy_tokens

if TYPE_CHECKING:
    from paged_jax.executor.batch import Batch


def make_draft_loop(step, block_size: int, num_steps: int):
    """``loop(params, kv_caches, batch, limits) -> (tokens int32[num_steps, S], kv_caches)`` jitted, for
    ``step`` the runner's step function (:func:`paged_jax.executor.model_runner.make_step`): step j
    runs row s's token at ``batch.positions[s] + j`` (its first token from ``batch.input_ids``, then
    the argmax of the step before) while ``j < limits[s]``."""

    def loop(params, kv_caches, batch: "Batch", limits):
        live_rows = batch.query_lens > 0

        def body(j, carry):
            kv, tokens, out = carry
            pos = batch.positions + j
            block = jnp.take_along_axis(batch.block_tables, (pos // block_size)[:, None], axis=1)[:, 0]
            slot = jnp.where(j < limits, block * block_size + pos % block_size, NULL_BLOCK * block_size)
            b = dataclasses.replace(batch, input_ids=tokens, positions=pos, rope_lengths=pos + 1, slot_mapping=slot,
                                    context_lens=jnp.where(live_rows, pos + 1, 0))
            step_out, kv = step(params, kv, b, False)
            # The step leaves greedy ids out past GREEDY_IN_STEP_MAX_LOGITS (many rows, a large vocabulary).
            ids = step_out.greedy_ids if step_out.greedy_ids is not None else greedy_tokens(step_out.logits)[0]
            return kv, ids, out.at[j].set(ids)

        out = jnp.zeros((num_steps, batch.block_tables.shape[0]), jnp.int32)
        kv_caches, _, out = lax.fori_loop(0, num_steps, body, (kv_caches, batch.input_ids, out))
        return out, kv_caches

    return jax.jit(loop, donate_argnums=(1,))


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
