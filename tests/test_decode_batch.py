"""A decode step's batch built by ``prepare_batch``'s decode path (``_decode_batch``: Python lists, a
few numpy calls) is the general path's batch, array for array: random rows, padding, block sizes,
block tables longer than the tokens, recomputed prompts (``prompt_len``), blocks at their boundaries."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.executor.batch import SeqChunk, prepare_batch


def assert_same_batch(fast, general):
    assert fast.shape_key == general.shape_key and fast.tile_size == general.tile_size
    for f in dataclasses.fields(general):
        a, b = getattr(fast, f.name), getattr(general, f.name)
        if b is None or isinstance(b, int):
            assert a == b, f.name
            continue
        assert a.dtype == b.dtype == np.int32 and a.shape == b.shape, f.name
        np.testing.assert_array_equal(a, b, err_msg=f.name)


@st.composite
def decode_rows(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    rows = []
    for _ in range(draw(st.integers(1, 9))):
        pos = draw(st.integers(0, 70))
        used = pos // block_size + 1
        table = draw(st.lists(st.integers(1, 500), min_size=used, max_size=used + 3))  # may reach further ahead
        prompt_len = draw(st.one_of(st.none(), st.integers(1, 90)))  # set: a recomputed prompt's original length
        rows.append(SeqChunk([draw(st.integers(0, 999))], pos, table, prompt_len))
    return rows, block_size


@settings(max_examples=150, deadline=None)
@given(decode_rows())
def test_decode_path_builds_the_general_paths_batch(case):
    chunks, block_size = case
    assert_same_batch(prepare_batch(chunks, block_size), prepare_batch(chunks, block_size, decode_path=False))


def test_decode_path_refuses_a_short_block_table_as_the_general_path_does():
    chunks = [SeqChunk([5], 3, [2]), SeqChunk([6], 8, [3, 4])]  # row 1 needs 3 blocks of 4 for 9 tokens
    for decode_path in (True, False):
        with pytest.raises(ValueError, match="sequence row 1 holds 2 blocks, too few for 9 tokens"):
            prepare_batch(chunks, 4, decode_path=decode_path)
