"""The Pallas kernels as attention backends (same signature and result as the reference).

- ``"pallas"``: the compiled kernels (Triton backend) on a GPU. On a machine without
  one it refuses with a ValueError at engine start (naming ``"pallas-interpret"`` and
  ``"reference"``): interpret mode is 100-1000x slower than the reference, which a
  user asking for a fast kernel would not want to get silently.
- ``"pallas-interpret"``: the same kernels in Pallas interpret mode, on any platform;
  for checking the kernels on a CPU, not for speed.

Dispatch is static (on the padded query length ``Q``): ``Q == 1`` (a pure decode step)
runs the decode kernel, ``Q > 1`` (prefill, chunked prefill, or a mixed step) the
prefill kernel, whose rows with one query are decodes.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention


def _auto_partition(S: int, H: int, max_context: int, partition_size: int = 512) -> int | None:
    """vLLM's rule: split only long contexts, and only when the batch alone cannot fill the GPU."""
    if max_context <= partition_size or S * H > 512:
        return None
    return partition_size


def paged_attention_pallas(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, *,
                           interpret: bool = False):
    """Backend body: q [S, Q, H, D] -> [S, Q, H, D]; see ``paged_attention_reference``."""
    S, Q, H, D = q.shape
    if Q > 1:
        return paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale,
                                       interpret=interpret)
    block_size = k_cache.shape[1]
    part = _auto_partition(S, H, block_tables.shape[1] * block_size)
    if part is not None and part % block_size:
        part = None
    out = paged_decode_attention(q[:, 0], k_cache, v_cache, block_tables, context_lens, scale, partition_size=part,
                                 interpret=interpret)
    return out[:, None]


paged_attention_pallas_interpret = functools.partial(paged_attention_pallas, interpret=True)
paged_attention_pallas_interpret.__doc__ = "Backend 'pallas-interpret': the Pallas kernels in interpret mode."


def require_gpu() -> None:
    """Availability check of the "pallas" backend."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"attention_backend='pallas' runs compiled Triton kernels and needs a CUDA GPU, but JAX's "
                         f"default backend is {jax.default_backend()!r}; use 'pallas-interpret' to run the same "
                         "kernels in interpret mode (slow, for checking) or 'reference' (plain jnp)")


def register() -> None:
    """Make ``attention_backend="pallas"`` and ``"pallas-interpret"`` available."""
    from paged_jax.attention import register_backend

    register_backend("pallas", paged_attention_pallas, check=require_gpu)
    register_backend("pallas-interpret", paged_attention_pallas_interpret)
