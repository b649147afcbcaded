"""Paged attention: the layer every model calls, and the backends it runs (see ``backends``).

A model layer calls ``attn(q, k, v, kv_cache)`` with ``attn`` =
:func:`paged_attention_layer` bound to the step's metadata, the layer's
:class:`AttentionSpec` (from the model config) and the engine's backend object. The layer
writes the step's K/V into the paged cache and hands the backend the step's decode rows
(``backend.decode``, one query per sequence) and, when some sequences have several new
tokens, their query tiles (``backend.prefill``): one ragged, token-flat step for decodes and
prefill chunks together.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from paged_jax.attention.backends import (AUTO, NATIVE, REFERENCE, NativeBackend, ReferenceBackend,
                                          available_backends, get_backend, register_backend, select_backend,
                                          soft_cap_mod, window_mask_mod)
from paged_jax.attention import kv_quant
from paged_jax.attention.decode import paged_decode_attention
from paged_jax.attention.metadata import AttentionMetadata
from paged_jax.attention.prefill import blockwise_prefill_attention
from paged_jax.attention.reference import paged_attention_reference
from paged_jax.attention.spec import AttentionSpec


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Scatter this step's K/V ([T, kv_heads, head_dim]) into their slots (quantized first into an
    8-bit cache, see :mod:`paged_jax.attention.kv_quant`)."""
    if kv_quant.kind(k_cache) != "auto":
        k, v = kv_quant.quantize(k, k_cache.dtype), kv_quant.quantize(v, v_cache.dtype)
    if slot_mapping.shape[0] == 1:
        # One token (a decode step of one sequence): written twice to its slot, the same values. XLA:CPU
        # turns a one-row scatter into an update that, read afterwards by attention, it cannot do in
        # place, and copied both whole caches in every layer (a second of a batch-1 step on the
        # GPT-2-124M shape without the native kernels).
        k, v, slot_mapping = (jnp.concatenate([x, x]) for x in (k, v, slot_mapping))
    nb, bs, kvh, d = k_cache.shape
    k_cache = k_cache.reshape(nb * bs, kvh, d).at[slot_mapping].set(k.astype(k_cache.dtype)).reshape(nb, bs, kvh, d)
    v_cache = v_cache.reshape(nb * bs, kvh, d).at[slot_mapping].set(v.astype(v_cache.dtype)).reshape(nb, bs, kvh, d)
    return k_cache, v_cache


def paged_attention_layer(q, k, v, kv_cache, *, meta: AttentionMetadata, spec: AttentionSpec, backend):
    """Write this step's K/V into the paged cache, then attend through the block tables.

    q: [T, H, D]; k, v: [T, KVH, D] (token-flat, ragged: see :mod:`~paged_jax.attention.metadata`).
    Returns ([T, H, D], (k_cache, v_cache)). Writes come first, so a sequence sees its own new
    tokens (and, with prefix sharing, blocks another sequence fills in the same step).

    A backend with a ``ragged`` method gets the whole step in one call. Otherwise every
    sequence's last new token goes through ``backend.decode`` (one query per row: a decode step
    is only this); the tokens of sequences with several new ones also go, in query tiles,
    through ``backend.prefill``, and their outputs are taken from there. Whether a step has
    tiles is static (their number is part of the step's shape).
    """
    k_cache, v_cache = write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
    ragged = getattr(backend, "ragged", None)
    if ragged is not None and meta.last_token is not None:
        return ragged(q, k_cache, v_cache, meta, spec), (k_cache, v_cache)
    T, H, D = q.shape
    rows = meta
    if meta.num_tiles:
        # Sequences with several new tokens get their outputs from their tiles: in the decode
        # call they are rows with nothing to attend to, like padded rows, and cost nothing.
        single = meta.query_lens == 1
        rows = dataclasses.replace(meta, context_lens=jnp.where(single, meta.context_lens, 0),
                                   query_lens=jnp.where(single, 1, 0))
    # Padded rows' last_token is 0: their query is any token's, and their output is never read.
    out = backend.decode(q[meta.last_token], k_cache, v_cache, rows, spec)
    out = out.at[meta.token_seq].get(mode="fill", fill_value=0)
    if meta.num_tiles:
        N, Qt = meta.num_tiles, meta.tile_size
        q_tiles = jnp.zeros((N, Qt, H, D), q.dtype).at[meta.token_tile, meta.token_tile_pos].set(q, mode="drop")
        tiled = backend.prefill(q_tiles, k_cache, v_cache, meta.tiles(), spec)
        tiled = tiled.at[meta.token_tile, meta.token_tile_pos].get(mode="fill", fill_value=0)
        out = jnp.where((meta.token_tile < N)[:, None, None], tiled, out)
    return out, (k_cache, v_cache)


register_backend(REFERENCE)
register_backend(NATIVE)


def _register_pallas() -> None:
    # pallas_kernels imports nothing from this package, so this is the only direction of the import.
    from pallas_kernels.backend import PALLAS, PALLAS_INTERPRET

    register_backend(PALLAS)
    register_backend(PALLAS_INTERPRET)


_register_pallas()

__all__ = ["AUTO", "NATIVE", "REFERENCE", "AttentionMetadata", "AttentionSpec", "NativeBackend", "ReferenceBackend",
           "available_backends", "get_backend", "paged_attention_layer", "paged_attention_reference", "paged_decode_attention",
           "blockwise_prefill_attention",
           "register_backend", "select_backend", "soft_cap_mod", "window_mask_mod", "write_kv"]
