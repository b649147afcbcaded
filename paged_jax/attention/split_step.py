"""One ragged entry point for every backend: :func:`as_ragged` gives a backend that has only
``decode`` and ``prefill`` the ``ragged`` method the layer calls, by splitting the step the one
way the metadata describes (:mod:`~paged_jax.attention.metadata`):

- every sequence's last new token through ``decode``, one query per row (a decode step is only
  this);
- the tokens of sequences with several new ones, in query tiles, through ``prefill``; their
  outputs are taken from there.

Whether a step has tiles is static (their number is part of the step's shape). A backend with a
ragged kernel of its own (``native``) is used as it is.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


class SplitStep:
    """``backend`` (with ``decode`` and ``prefill``) with a ``ragged`` method; everything else is
    the backend's own (name, declarations, check)."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):  # name, spec_fields, dtypes, check, decode, prefill, hooks ...
        return getattr(self.backend, name)

    def ragged(self, q, k_cache, v_cache, meta, spec, **kw):  # kw: sinks, for a backend declaring them
        T, H, D = q.shape
        rows = meta
        if meta.num_tiles:
            # Sequences with several new tokens get their outputs from their tiles: in the decode
            # call they are rows with nothing to attend to, like padded rows, and cost nothing.
            single = meta.query_lens == 1
            rows = dataclasses.replace(meta, context_lens=jnp.where(single, meta.context_lens, 0),
                                       query_lens=jnp.where(single, 1, 0))
        # Padded rows' last_token is 0: their query is any token's, and their output is never read.
        out = self.backend.decode(q[meta.last_token], k_cache, v_cache, rows, spec, **kw)
        out = out.at[meta.token_seq].get(mode="fill", fill_value=0)
        if meta.num_tiles:
            N, Qt = meta.num_tiles, meta.tile_size
            q_tiles = jnp.zeros((N, Qt, H, D), q.dtype).at[meta.token_tile, meta.token_tile_pos].set(q, mode="drop")
            tiled = self.backend.prefill(q_tiles, k_cache, v_cache, meta.tiles(), spec, **kw)
            tiled = tiled.at[meta.token_tile, meta.token_tile_pos].get(mode="fill", fill_value=0)
            out = jnp.where((meta.token_tile < N)[:, None, None], tiled, out)
        return out


def as_ragged(backend):
    """``backend`` if it has a ``ragged`` method, else it wrapped in :class:`SplitStep`."""
    return backend if callable(getattr(backend, "ragged", None)) else SplitStep(backend)
