"""Token-flat batches in numpy, padded to buckets (the executor's side of the border).

Each running sequence contributes a *chunk*: its new tokens this step (a whole
prompt, a prefill chunk, or one decode token), the position of the first of
them, and its block table. ``prepare_batch`` turns the chunks into a :class:`Batch`,
the one pytree the jitted step takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from paged_jax.attention.metadata import AttentionMetadata, array_field
from paged_jax.memory.block_allocator import NULL_BLOCK  # padded rows read it and padded tokens write it
from paged_jax.utils import pow2_bucket as bucket


@dataclass
class SeqChunk:
    token_ids: list[int]  # the tokens to run this step
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]  # covers start_pos + len(token_ids) tokens (blocks past them are not sent)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, kw_only=True)
class Batch(AttentionMetadata):
    """One step's arrays: the attention metadata (this is its subclass, so attention sees the
    batch itself) plus the model's inputs. A pytree whose static part is ``max_query_len``;
    with the array shapes that make the bucket, :attr:`shape_key`."""

    input_ids: jax.Array = array_field("T")
    positions: jax.Array = array_field("T")
    logits_indices: jax.Array = array_field("S")  # flat index of each sequence's last token

    @property
    def shape_key(self) -> tuple[int, int, int, int]:
        """(tokens T, sequences S, blocks per table B, max_query_len Q): what a step compiles for."""
        return (self.input_ids.shape[0], self.block_tables.shape[0], self.block_tables.shape[1], self.max_query_len)

    @classmethod
    def abstract(cls, shape_key: tuple[int, int, int, int]) -> "Batch":
        """A batch of ``jax.ShapeDtypeStruct`` leaves for ``shape_key``, to compile against."""
        T, S, B, Q = shape_key
        sizes = {"T": T, "S": S, "B": B}
        return cls(max_query_len=Q, **{f.name: jax.ShapeDtypeStruct(tuple(sizes[d] for d in f.metadata["dims"]),
                                                                    np.int32)
                                       for f in dataclasses.fields(cls) if "dims" in f.metadata})

    # Host-side counts (numpy leaves only): every real sequence has at least one new token.
    @property
    def num_seqs(self) -> int:
        """Real (unpadded) sequences."""
        return int(np.count_nonzero(self.query_lens))

    @property
    def num_tokens(self) -> int:
        """Real tokens."""
        return int(np.sum(self.query_lens))


def prepare_batch(chunks: list[SeqChunk], block_size: int, min_tokens: int = 8, min_seqs: int = 1,
                  min_blocks: int = 4) -> Batch:
    """Pad ``chunks`` into bucketed arrays. Token, sequence, block-table width and
    query-length dimensions are each rounded up to a power of two."""
    S = len(chunks)
    T = sum(len(c.token_ids) for c in chunks)
    max_q = max(len(c.token_ids) for c in chunks)
    # Only the blocks holding the tokens so far: a table reserved further ahead (the Orca policies)
    # would widen the step's shape and what attention reads, for blocks it never looks at.
    max_b = max(min(len(c.block_table), -(-(c.start_pos + len(c.token_ids)) // block_size)) for c in chunks)
    Tp, Sp, Bp = bucket(T, min_tokens), bucket(S, min_seqs), bucket(max_b, min_blocks)
    Qp = bucket(max_q)

    input_ids = np.zeros(Tp, np.int32)
    positions = np.zeros(Tp, np.int32)
    slot_mapping = np.full(Tp, NULL_BLOCK * block_size, np.int32)
    token_seq = np.full(Tp, Sp, np.int32)  # out of range: padding is dropped
    token_qidx = np.zeros(Tp, np.int32)
    block_tables = np.full((Sp, Bp), NULL_BLOCK, np.int32)
    context_lens = np.zeros(Sp, np.int32)
    query_lens = np.zeros(Sp, np.int32)
    logits_indices = np.zeros(Sp, np.int32)

    t = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        end = c.start_pos + n
        if len(c.block_table) * block_size < end:
            raise ValueError(f"block table of sequence row {s} holds {len(c.block_table)} blocks, "
                             f"too few for {end} tokens at block size {block_size}")
        pos = np.arange(c.start_pos, end, dtype=np.int32)
        table = np.asarray(c.block_table[:-(-end // block_size)], np.int32)
        input_ids[t:t + n] = c.token_ids
        positions[t:t + n] = pos
        slot_mapping[t:t + n] = table[pos // block_size] * block_size + pos % block_size
        token_seq[t:t + n] = s
        token_qidx[t:t + n] = np.arange(n)
        block_tables[s, :len(table)] = table
        context_lens[s] = end
        query_lens[s] = n
        logits_indices[s] = t + n - 1
        t += n
    return Batch(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, token_seq=token_seq,
                 token_qidx=token_qidx, block_tables=block_tables, context_lens=context_lens, query_lens=query_lens,
                 logits_indices=logits_indices, max_query_len=Qp)


def split_chunks(chunks: list[SeqChunk], one_batch: bool = False) -> list[tuple[int, list[int]]]:
    """Group a step's chunks into batches: ``[(Q, row indices)]``, prompts first.

    Decode rows (one token, ``Q = 1``) form one batch and prompt rows one batch per query-length
    bucket ``Q``: in a single batch, attention pads every row to the longest query, and the step
    shapes would be (tokens x rows x Q) instead of (rows x Q). ``one_batch``: all rows together
    (``Q = 0``, the plain :func:`prepare_batch` buckets)."""
    parts: dict[int, list[int]] = {}
    for i, c in enumerate(chunks):
        parts.setdefault(0 if one_batch else bucket(len(c.token_ids)), []).append(i)
    return sorted(parts.items(), reverse=True)


def prepare_part(chunks: list[SeqChunk], q: int, block_size: int) -> Batch:
    """:func:`prepare_batch` for one group of :func:`split_chunks`: ``S`` prompt rows of query
    bucket ``Q > 1`` are padded to ``bucket(S) * Q`` tokens (at least 8)."""
    return prepare_batch(chunks, block_size, min_tokens=max(8, bucket(len(chunks)) * q))


def warmup_shapes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                  min_tokens: int = 8, min_blocks: int = 4) -> list[tuple[int, int, int, int]]:
    """The step shapes (``Batch.shape_key``) a run can reach, for compiling them up front.

    The runner batches decode rows (one token) together and prompt rows by their query-length
    bucket ``Q`` (see ``ModelRunner.execute``), a batch of ``S`` prompt rows padded to ``S * Q``
    tokens. So the shapes are: decode, every sequence bucket up to ``max_num_seqs`` times every
    block-table bucket up to ``max_model_len``; prefill, every (``S``, ``Q``) whose rows fit the
    token budget, with the block-table width a ``Q``-token prompt needs. Prefix caching and
    chunked prefill can give prompt rows longer tables than their query: those shapes, and
    the single batch of a step that asks for prompt logprobs, compile on first use."""
    top_s = bucket(max_num_seqs)
    top_b = bucket(-(-max_model_len // block_size), min_blocks)
    shapes = []
    s = 1
    while s <= top_s:
        b = min_blocks
        while b <= top_b:
            shapes.append((bucket(s, min_tokens), s, b, 1))
            b *= 2
        s *= 2
    max_q = min(max_model_len, max_num_batched_tokens)
    q = 2
    while q <= bucket(max_q):
        q_lo, q_hi = q // 2 + 1, min(q, max_q)
        b_lo, b_hi = (bucket(-(-n // block_size), min_blocks) for n in (q_lo, q_hi))
        s = 1
        # s rows of this bucket: more than s // 2 of them, each more than q // 2 tokens.
        while s <= top_s and (s // 2 + 1) * q_lo <= max_num_batched_tokens and s // 2 + 1 <= max_num_seqs:
            b = b_lo
            while b <= b_hi:
                shapes.append((bucket(s * q, min_tokens), s, b, q))
                b *= 2
            s *= 2
        q *= 2
    return shapes
