"""Attention backends: one function signature, chosen by name.

A backend is ``fn(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale) -> out``
with the shapes of :func:`paged_attention_reference`. Built in: ``"reference"`` (plain
jnp, the definition), ``"pallas"`` (the Pallas kernels compiled for a CUDA GPU; refused
elsewhere) and ``"pallas-interpret"`` (the same kernels in interpret mode, any platform).
Adding a variant is one file: write the function (usually the reference with a
``score_mod`` or ``mask_mod`` hook, see ``paged_jax/attention/variants/``) and
``register_backend("name", fn)``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax.numpy as jnp

from paged_jax.attention.metadata import AttentionMetadata
from paged_jax.attention.spec import AttentionSpec
from paged_jax.attention.decode import paged_decode_attention
from paged_jax.attention.reference import paged_attention_reference

_BACKENDS: dict[str, tuple[Callable, Optional[Callable[[], None]]]] = {"reference": (paged_attention_reference, None)}


def register_backend(name: str, fn: Callable, check: Optional[Callable[[], None]] = None) -> None:
    """Make ``fn`` available as ``attention_backend=name`` (replacing any backend of that name).

    ``check``, if given, is called by :func:`get_backend` (when an engine starts) and
    raises ValueError with a clear message when the backend cannot run here.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise ValueError(f"backend {name!r} must be a callable, got {fn!r}")
    _BACKENDS[name] = (fn, check)


def get_backend(name: str) -> Callable:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(_BACKENDS)}, got {name!r}")
    fn, check = _BACKENDS[name]
    if check is not None:
        check()
    return fn


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def soft_cap_mod(cap: Optional[float]):
    """The reference's ``score_mod`` for logit soft-capping (None: no hook)."""
    return None if cap is None else (lambda s, q_pos, k_pos: cap * jnp.tanh(s / cap))


def window_mask_mod(window: Optional[int]):
    """The reference's ``mask_mod`` for a sliding window (None: no hook)."""
    return None if window is None else (lambda q_pos, k_pos: k_pos > q_pos - window)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Scatter this step's K/V ([T, kv_heads, head_dim]) into their slots."""
    nb, bs, kvh, d = k_cache.shape
    k_cache = k_cache.reshape(nb * bs, kvh, d).at[slot_mapping].set(k.astype(k_cache.dtype)).reshape(nb, bs, kvh, d)
    v_cache = v_cache.reshape(nb * bs, kvh, d).at[slot_mapping].set(v.astype(v_cache.dtype)).reshape(nb, bs, kvh, d)
    return k_cache, v_cache


def paged_attention_layer(q, k, v, kv_cache, *, meta: AttentionMetadata, spec: AttentionSpec, backend: Callable):
    """Write this step's K/V into the paged cache, then attend through the block tables.

    q: [T, H, D]; k, v: [T, KVH, D] (token-flat). Returns ([T, H, D], (k_cache, v_cache)).
    Writes come first, so a sequence sees its own new tokens (and, with prefix
    sharing, blocks another sequence fills in the same step).
    """
    k_cache, v_cache = write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
    scale = spec.scale
    if spec.sliding_window is not None or spec.logit_soft_cap is not None:
        backend = functools.partial(paged_attention_reference, score_mod=soft_cap_mod(spec.logit_soft_cap),
                                    mask_mod=window_mask_mod(spec.sliding_window))
    S = meta.block_tables.shape[0]
    T, H, D = q.shape
    if meta.max_query_len == 1 and backend is paged_attention_reference:
        # Decode batch: the same function, in the layout XLA's CPU backend runs fastest.
        q_rows = jnp.zeros((S, H, D), q.dtype).at[meta.token_seq].set(q, mode="drop")
        out = paged_decode_attention(q_rows, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return out.at[meta.token_seq].get(mode="fill", fill_value=0), (k_cache, v_cache)
    q_pad = jnp.zeros((S, meta.max_query_len, H, D), q.dtype).at[meta.token_seq, meta.token_qidx].set(q, mode="drop")
    out = backend(q_pad, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens, scale)
    out = out.at[meta.token_seq, meta.token_qidx].get(mode="fill", fill_value=0)
    return out, (k_cache, v_cache)


__all__ = ["AttentionMetadata", "AttentionSpec", "paged_attention_reference", "paged_decode_attention", "register_backend", "get_backend",
           "available_backends", "write_kv", "paged_attention_layer"]
from pallas_kernels.backend import register as _register_pallas  # noqa: E402

_register_pallas()
import paged_jax.attention.variants  # noqa: E402,F401  (registers "soft-cap" and "sliding-window")
