"""The arrays that tell attention where each token's K/V live (crossing into jit).

The batch is token-flat: ``T`` tokens (padded to a bucket) from ``S`` sequences
(padded to a bucket). Each sequence contributes ``query_lens[s]`` consecutive
new tokens (1 for decode, a whole prompt or a chunk of one for prefill); its
keys and values are all in the paged cache, addressed by ``block_tables[s]``.

The executor's step batch (``paged_jax.executor.batch.Batch``) is this pytree plus the
model's inputs: attention sees the batch through this view. Each array field names its
dimensions (``dims``) once, for the abstract batch warm-up compiles against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax


def array_field(*dims: str):
    """A batch array (int32) of shape ``dims``: ``"T"`` tokens, ``"S"`` sequences, ``"B"`` blocks per table."""
    return field(metadata=dict(dims=dims))


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    # Per token [T]
    slot_mapping: jax.Array = array_field("T")  # block * block_size + offset of the token's K/V (null block: padding)
    token_seq: jax.Array = array_field("T")  # row of the token's sequence in block_tables (S for padding: dropped)
    token_qidx: jax.Array = array_field("T")  # index of the token among its sequence's new tokens
    # Per sequence [S]
    block_tables: jax.Array = array_field("S", "B")  # physical blocks, 0 (null block) past the end
    context_lens: jax.Array = array_field("S")  # tokens in the cache for the sequence once this step has written
    query_lens: jax.Array = array_field("S")  # new tokens of the sequence in this step (0 for padded rows)
    # Static (part of the jit cache key): the widest query of any sequence, padded to a bucket (1 for pure decode).
    max_query_len: int = field(default=1, metadata=dict(static=True))
