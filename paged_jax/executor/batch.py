"""Token-flat batches in numpy, padded to buckets (the executor's side of the border).

Each running sequence contributes a *chunk*: its new tokens this step (a whole
prompt, a prefill chunk, or one decode token), the position of the first of
them, and its block table. ``prepare_batch`` turns a step's chunks into one ragged
:class:`Batch` (decodes and prefill chunks together, no sequence padded to another's
length), the one pytree the jitted step takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import jax
import numpy as np

from paged_jax.attention.metadata import TILE_SIZE, AttentionMetadata, array_field
from paged_jax.memory.block_allocator import NULL_BLOCK  # padded rows read it and padded tokens write it
from paged_jax.utils import pow2_bucket as bucket


@dataclass
class SeqChunk:
    token_ids: list[int]  # the tokens to run this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    # Covers start_pos + len(token_ids) tokens (blocks past them are not sent); with several layer
    # groups, a GroupBlockTables (``per_group``: each group's table).
    block_table: list[int]
    # The request's original prompt length (a recomputed sequence reruns its generated tokens as
    # prompt, but they keep theirs); None: the chunk ends the prompt (a whole prompt, or a decode).
    prompt_len: Optional[int] = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class Batch(AttentionMetadata):
    """One step's arrays: the attention metadata (this is its subclass, so attention sees the
    batch itself) plus the model's inputs. A pytree whose static part is ``tile_size``;
    with the array shapes that make the bucket, :attr:`shape_key`."""

    input_ids: jax.Array = array_field("T")
    positions: jax.Array = array_field("T")
    # Dynamic NTK RoPE's rotation length L = max(prompt length, position + 1) of each token: what
    # transformers' generate rotates it for (ModelConfig.rope_frequencies). Others ignore it.
    rope_lengths: jax.Array = array_field("T")

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        """(tokens T, sequences S, blocks per table B, query tiles N): what a step compiles for."""
        return (self.input_ids.shape[0], self.block_tables.shape[0], self.block_tables.shape[1],
                self.tile_seq.shape[0])

    @classmethod
    def abstract(cls, shape_key: tuple[int, int, int, int], num_groups: int = 1) -> "Batch":
        """A batch of ``jax.ShapeDtypeStruct`` leaves for ``shape_key`` (and ``num_groups`` layer
        groups), to compile against."""
        T, S, B, N = shape_key
        sizes = {"T": T, "S": S, "B": B, "N": N, "G": num_groups}
        return cls(**{f.name: jax.ShapeDtypeStruct(tuple(sizes[d] for d in f.metadata["dims"]), np.int32)
                      for f in dataclasses.fields(cls)
                      if "dims" in f.metadata and ("G" not in f.metadata["dims"] or num_groups > 1)})

    # Host-side counts (numpy leaves only): every real sequence has at least one new token.
    @property
    def num_seqs(self) -> int:
        """Real (unpadded) sequences."""
        return int(np.count_nonzero(self.query_lens))

    @property
    def num_tokens(self) -> int:
        """Real tokens."""
        return int(np.sum(self.query_lens))


def num_tiles(query_len: int, tile_size: int = TILE_SIZE) -> int:
    """Query tiles of a sequence with ``query_len`` new tokens (a decode has none)."""
    return 0 if query_len <= 1 else -(-query_len // tile_size)


def tile_capacity(num_tokens_bucket: int, tile_size: int = TILE_SIZE) -> int:
    """Query tiles a step of ``num_tokens_bucket`` tokens has room for: what its tokens fill, plus one
    part-empty tile per 32 tokens (room for that many short prompts), at least 4. Tied to the
    token bucket so that a step's shape has no dimension of its own for tiles."""
    return max(4, num_tokens_bucket // tile_size + num_tokens_bucket // 32)


def step_buckets(num_tokens: int, num_seqs: int, min_tokens: int = 8) -> tuple[int, int]:
    """(T, S) buckets of a step: a decode step (every sequence one token) pads both to the
    sequence bucket, with no token minimum (each padded token row is a row of every matmul:
    eight rows for one sequence made the batch-1 step about a fifth slower on the CPU); a step
    with prefill tokens has as many sequence rows as token rows (one bucket of at least
    ``min_tokens``, ``T = S``, as a ragged batch can hold one sequence per token)."""
    if num_tokens == num_seqs:
        s = bucket(num_seqs)
        return s, s
    t = bucket(num_tokens, min_tokens)
    return t, t


def split_steps(chunks: list[SeqChunk], tile_size: int = TILE_SIZE, min_tokens: int = 8) -> list[list[int]]:
    """Group a step's chunks into as few batches as possible, in order: one, unless its
    prefilling sequences need more query tiles than :func:`tile_capacity` gives its token
    bucket (many short prompts at once); then consecutive runs of rows that each fit."""
    parts, rows, tokens, tiles = [], [], 0, 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        t, nt = tokens + n, tiles + num_tiles(n, tile_size)
        if rows and nt > tile_capacity(bucket(t, min_tokens), tile_size):
            parts.append(rows)
            rows, t, nt = [], n, num_tiles(n, tile_size)
        rows.append(i)
        tokens, tiles = t, nt
    return parts + [rows]


def prepare_batch(chunks: list[SeqChunk], block_size: int, min_tokens: int = 8, min_blocks: int = 4,
                  tile_size: int = TILE_SIZE, decode_path: bool = True, capacity=tile_capacity) -> Batch:
    """Pad ``chunks`` into one ragged, token-flat batch. The token, sequence and block-table
    dimensions are each rounded up to a power of two (:func:`step_buckets`); the query tiles
    are :func:`tile_capacity` of the token bucket (more if the chunks need more: :func:`split_steps`
    keeps to the capacity), or none in a decode step; ``capacity(T, tile_size)`` gives that number
    (:func:`paged_jax.executor.draft_rows.verification_tiles` for a verification step). ``decode_path``: a decode step with one layer
    group takes :func:`_decode_batch` (False: the general path, which gives the same arrays)."""
    S = len(chunks)
    T = sum(len(c.token_ids) for c in chunks)
    tables_of = [getattr(c.block_table, "per_group", [c.block_table]) for c in chunks]
    G = len(tables_of[0])
    # Only the blocks holding the tokens so far: a table reserved further ahead (the Orca policies)
    # would widen the step's shape and what attention reads, for blocks it never looks at.
    max_b = max(min(len(c.block_table), -(-(c.start_pos + len(c.token_ids)) // block_size)) for c in chunks)
    Tp, Sp = step_buckets(T, S, min_tokens)
    Bp = bucket(max_b, min_blocks)
    if decode_path and T == S and G == 1:
        return _decode_batch(chunks, block_size, Sp, Bp, tile_size)
    need = sum(num_tiles(len(c.token_ids), tile_size) for c in chunks)
    # More tiles than the token bucket holds (chunks not grouped by split_steps): a shape of its own.
    Np = capacity(Tp, tile_size) if need else 0
    if need > Np:
        Np = bucket(need)

    input_ids = np.zeros(Tp, np.int32)
    positions = np.zeros(Tp, np.int32)
    rope_lengths = np.zeros(Tp, np.int32)
    slot_mapping = np.full((G, Tp), NULL_BLOCK * block_size, np.int32)
    token_seq = np.full(Tp, Sp, np.int32)  # out of range: padding is dropped
    token_tile = np.full(Tp, Np, np.int32)  # out of range: not in a tile
    token_tile_pos = np.zeros(Tp, np.int32)
    block_tables = np.full((G, Sp, Bp), NULL_BLOCK, np.int32)
    context_lens = np.zeros(Sp, np.int32)
    query_lens = np.zeros(Sp, np.int32)
    last_token = np.zeros(Sp, np.int32)
    tile_seq = np.full(Np, Sp, np.int32)
    tile_context_lens = np.zeros(Np, np.int32)
    tile_query_lens = np.zeros(Np, np.int32)

    t = tile = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        end = c.start_pos + n
        if len(c.block_table) * block_size < end:
            raise ValueError(f"block table of sequence row {s} holds {len(c.block_table)} blocks, "
                             f"too few for {end} tokens at block size {block_size}")
        pos = np.arange(c.start_pos, end, dtype=np.int32)
        input_ids[t:t + n] = c.token_ids
        positions[t:t + n] = pos
        rope_lengths[t:t + n] = np.maximum(end if c.prompt_len is None else c.prompt_len, pos + 1)
        for g, group_table in enumerate(tables_of[s]):
            table = np.asarray(group_table[:-(-end // block_size)], np.int32)
            slot_mapping[g, t:t + n] = table[pos // block_size] * block_size + pos % block_size
            block_tables[g, s, :len(table)] = table
        token_seq[t:t + n] = s
        context_lens[s] = end
        query_lens[s] = n
        last_token[s] = t + n - 1
        for first in range(0, n, tile_size) if n > 1 else ():
            q = min(tile_size, n - first)
            token_tile[t + first:t + first + q] = tile
            token_tile_pos[t + first:t + first + q] = np.arange(q)
            tile_seq[tile] = s
            tile_context_lens[tile] = c.start_pos + first + q
            tile_query_lens[tile] = q
            tile += 1
        t += n
    groups = dict(group_block_tables=block_tables, group_slot_mapping=slot_mapping) if G > 1 else {}
    return Batch(input_ids=input_ids, positions=positions, rope_lengths=rope_lengths, slot_mapping=slot_mapping[0],
                 token_seq=token_seq, token_tile=token_tile, token_tile_pos=token_tile_pos,
                 block_tables=block_tables[0], context_lens=context_lens, query_lens=query_lens, last_token=last_token,
                 tile_seq=tile_seq, tile_context_lens=tile_context_lens, tile_query_lens=tile_query_lens,
                 tile_size=tile_size, **groups)


def _decode_batch(chunks: list[SeqChunk], block_size: int, Sp: int, Bp: int, tile_size: int) -> Batch:
    """:func:`prepare_batch` of a decode step (every chunk one token, one layer group): the same arrays,
    from Python lists in a few numpy calls. The host code between two device steps runs with its
    caches emptied by the step (prepare_batch took 0.14 ms right after a batch-1 step against 0.02
    ms run twice in a row on the benchmark CPU): this path touches less of numpy."""
    cols, tables = [], np.full((Sp, Bp), NULL_BLOCK, np.int32)
    for s, c in enumerate(chunks):
        pos = c.start_pos
        used = pos // block_size + 1
        if len(c.block_table) < used:
            raise ValueError(f"block table of sequence row {s} holds {len(c.block_table)} blocks, "
                             f"too few for {pos + 1} tokens at block size {block_size}")
        tables[s, :used] = c.block_table[:used]
        rope = pos + 1 if c.prompt_len is None else max(c.prompt_len, pos + 1)
        slot = c.block_table[pos // block_size] * block_size + pos % block_size
        # input_ids, positions, rope_lengths, slot_mapping, token_seq, context_lens, query_lens, last_token
        cols.append((c.token_ids[0], pos, rope, slot, s, pos + 1, 1, s))
    cols += [(0, 0, 0, NULL_BLOCK * block_size, Sp, 0, 0, 0)] * (Sp - len(chunks))  # padded rows
    ids, positions, rope, slots, seqs, context, queries, last = np.array(cols, np.int32).T.copy()
    zeros, empty = np.zeros(Sp, np.int32), np.zeros(0, np.int32)  # no query tiles (N = 0)
    return Batch(input_ids=ids, positions=positions, rope_lengths=rope, slot_mapping=slots, token_seq=seqs,
                 token_tile=zeros, token_tile_pos=zeros.copy(), block_tables=tables, context_lens=context,
                 query_lens=queries, last_token=last, tile_seq=empty, tile_context_lens=empty.copy(),
                 tile_query_lens=empty.copy(), tile_size=tile_size)


def warmup_shapes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                  min_tokens: int = 8, min_blocks: int = 4) -> list[tuple[int, int, int, int]]:
    """The step shapes (``Batch.shape_key``) a run can reach, for compiling them up front.

    Decode steps: every sequence bucket up to ``max_num_seqs`` times every block-table bucket up
    to ``max_model_len``. Steps with prefill tokens: every token bucket up to the token budget
    ``max_num_batched_tokens`` (sequences and query tiles follow from it, :func:`step_buckets`,
    :func:`tile_capacity`) times every block-table bucket. That covers chunked prefill and
    prefix caching too; only a step asking for prompt logprobs compiles on first use."""
    top_s = bucket(max_num_seqs)
    top_b = bucket(-(-max_model_len // block_size), min_blocks)
    widths = [b for b in (min_blocks << i for i in range(64)) if b <= top_b]
    shapes = []
    s = 1
    while s <= top_s:
        t, _ = step_buckets(s, s, min_tokens)
        shapes += [(t, s, b, 0) for b in widths]
        s *= 2
    t = bucket(2, min_tokens)  # the fewest tokens of a step with a prefill chunk
    while t <= bucket(max_num_batched_tokens, min_tokens):
        # The widest table such a step can have: its longest sequence, within max_model_len.
        shapes += [(t, t, b, tile_capacity(t)) for b in widths]
        t *= 2
    return shapes
