"""Paged attention: the layer every model calls, and the backends it runs (see ``backends``).

A model layer calls ``attn(q, k, v, kv_cache)`` with ``attn`` =
:func:`paged_attention_layer` bound to the step's metadata, the layer's
:class:`AttentionSpec` (from the model config) and the engine's backend object. The layer
writes the step's K/V into the paged cache and hands the backend the whole ragged, token-flat
step (decodes and prefill chunks together) in one call, ``backend.ragged`` (for a backend with
only ``decode`` and ``prefill``, :mod:`~paged_jax.attention.split_step` splits it).
"""

from __future__ import annotations

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
from paged_jax.attention.split_step import SplitStep, as_ragged


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Scatter this step's K/V ([T, kv_heads, head_dim]) into their slots (quantized first into an
    8-bit cache, or as bfloat16 bits into a uint16 one, see :mod:`paged_jax.attention.kv_quant`)."""
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


def paged_attention_layer(q, k, v, kv_cache, *, meta: AttentionMetadata, spec: AttentionSpec, backend, sinks=None):
    """Write this step's K/V into the paged cache, then attend through the block tables.

    q: [T, H, D]; k, v: [T, KVH, D] (token-flat, ragged: see :mod:`~paged_jax.attention.metadata`).
    Returns ([T, H, D], (k_cache, v_cache)). Writes come first, so a sequence sees its own new
    tokens (and, with prefix sharing, blocks another sequence fills in the same step).

    The backend attends the whole step in one call, ``ragged`` (:func:`as_ragged` gives a backend
    with only ``decode`` and ``prefill`` one that splits the step into decode rows and query tiles).
    ``sinks`` ([H], the layer's sink logits) comes exactly when ``spec.sinks`` says the layer has them,
    and only then reaches the backend (which declared the field, or was refused at start).
    """
    if spec.sinks != (sinks is not None):
        raise ValueError(f"attention spec sinks={spec.sinks} but the layer passed "
                         f"{'no sink logits' if sinks is None else 'sink logits'}")
    k_cache, v_cache = write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
    kw = {} if sinks is None else {"sinks": sinks}
    return as_ragged(backend).ragged(q, k_cache, v_cache, meta, spec, **kw), (k_cache, v_cache)


register_backend(REFERENCE)
register_backend(NATIVE)


def _register_pallas() -> None:
    # pallas_kernels imports nothing from this package, so this is the only direction of the import.
    from pallas_kernels.backend import PALLAS, PALLAS_INTERPRET

    register_backend(PALLAS)
    register_backend(PALLAS_INTERPRET)


_register_pallas()

__all__ = ["SplitStep", "as_ragged", "AUTO", "NATIVE", "REFERENCE", "AttentionMetadata", "AttentionSpec", "NativeBackend", "ReferenceBackend",
           "available_backends", "get_backend", "paged_attention_layer", "paged_attention_reference", "paged_decode_attention",
           "blockwise_prefill_attention",
           "register_backend", "select_backend", "soft_cap_mod", "window_mask_mod", "write_kv"]
