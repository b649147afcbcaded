"""The arrays that tell attention where each token's K/V live (crossing into jit).

The batch is token-flat and ragged: ``T`` tokens (padded to a bucket) from ``S`` sequences
(padded to a bucket), every sequence's new tokens consecutive, decodes and prefill chunks
side by side in one step. Each sequence contributes ``query_lens[s]`` new tokens (1 for a
decode, a whole prompt or a chunk of one for prefill); its keys and values are all in the
paged cache, addressed by ``block_tables[s]``.

A backend with a ``ragged`` entry point takes the step as it is (token-flat queries, each
sequence's ending at ``last_token``). For the others, attention runs two kinds of work over one
step (``paged_attention_layer``):

- *decode*: each sequence's last new token (``last_token[s]``), one query per row;
- *query tiles*: the new tokens of every sequence with more than one, cut into tiles of at
  most ``tile_size`` consecutive queries of one sequence. A tile is handed to the backend's
  prefill as a sequence of its own: same block table, ``tile_context_lens`` keys (up to its
  last query) and ``tile_query_lens`` queries, so its query ``i`` sits at position
  ``tile_context_lens - tile_query_lens + i`` as in any prefill. No sequence is padded to
  the longest one in the step: the padding is under one tile per prefilling sequence.

A model with several layer groups (``paged_jax.memory.layer_groups``: Gemma's windowed layers
beside global ones) has one block table per group: ``group_block_tables`` and
``group_slot_mapping`` hold every group's, and a layer attends through its group's view
(:meth:`AttentionMetadata.for_group`); with one group they are None and ``block_tables`` /
``slot_mapping`` serve every layer.

A step with no tiles (``N = 0``) is a decode step. The executor's step batch
(``paged_jax.executor.batch.Batch``) is this pytree plus the model's inputs: attention sees
the batch through this view. Each array field names its dimensions (``dims``) once, for the
abstract batch warm-up compiles against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from paged_jax.memory.block_allocator import NULL_BLOCK

# Queries per tile: the default chunked-prefill budget, so that a chunk is one tile. Each tile
# gathers its sequence's K/V on its own (the reference's blockwise prefill), so a chunk cut into
# small tiles repeats that gather (tiles of 32 made a 240-token chunk at a 4k context 2.5x slower
# on the CPU); a short prompt pads only its attention queries, not the model's tokens.
TILE_SIZE = 256


def array_field(*dims: str, **kw):
    """A batch array (int32) of shape ``dims``: ``"T"`` tokens, ``"S"`` sequences, ``"B"`` blocks
    per table, ``"N"`` query tiles, ``"G"`` layer groups."""
    return field(metadata=dict(dims=dims), **kw)


def step_field(*dims: str):
    """An array only a whole step needs (the layer reads it; a backend never does): ``None`` in
    metadata built by hand for a backend's ``decode`` or ``prefill`` alone."""
    return array_field(*dims, default=None)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    # Per token [T]
    slot_mapping: jax.Array = array_field("T")  # block * block_size + offset of the token's K/V (null block: padding)
    token_seq: jax.Array = array_field("T")  # row of the token's sequence in block_tables (S for padding: dropped)
    token_tile: jax.Array = step_field("T")  # the token's query tile (N: none, a decode's token or padding)
    token_tile_pos: jax.Array = step_field("T")  # the token's index in its tile
    # Per sequence [S]
    block_tables: jax.Array = array_field("S", "B")  # physical blocks, 0 (null block) past the end
    context_lens: jax.Array = array_field("S")  # tokens in the cache for the sequence once this step has written
    query_lens: jax.Array = array_field("S")  # new tokens of the sequence in this step (0 for padded rows)
    last_token: jax.Array = step_field("S")  # flat index of the sequence's last new token (0 for padded rows)
    # Per query tile [N]
    tile_seq: jax.Array = step_field("N")  # row of the tile's sequence (S for padding: the null block's table)
    tile_context_lens: jax.Array = step_field("N")  # keys the tile's last query sees (0 for padding)
    tile_query_lens: jax.Array = step_field("N")  # queries in the tile (0 for padding)
    # Per layer group [G, ...], with several groups (None with one): each group's block_tables, slot_mapping
    group_block_tables: jax.Array = array_field("G", "S", "B", default=None)
    group_slot_mapping: jax.Array = array_field("G", "T", default=None)
    # Static (part of the jit cache key)
    tile_size: int = field(default=TILE_SIZE, metadata=dict(static=True))

    @property
    def num_tiles(self) -> int:
        """Query tiles (padded): 0 for a decode step."""
        return 0 if self.tile_seq is None else self.tile_seq.shape[0]

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata a layer of layer group ``group`` attends through: its group's tables and slots."""
        if self.group_block_tables is None:
            return self
        return dataclasses.replace(self, block_tables=self.group_block_tables[group],
                                   slot_mapping=self.group_slot_mapping[group], group_block_tables=None,
                                   group_slot_mapping=None)

    def tiles(self) -> "AttentionMetadata":
        """The query tiles as a prefill batch of their own (inside jit): one row per tile, with its
        sequence's block table (the null block's for padded tiles) and the tile's lengths."""
        tables = jnp.take(self.block_tables, self.tile_seq, axis=0, mode="fill", fill_value=NULL_BLOCK)
        return dataclasses.replace(self, block_tables=tables, context_lens=self.tile_context_lens,
                                   query_lens=self.tile_query_lens)
