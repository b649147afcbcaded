"""The Pallas kernels as attention backends (``paged_jax.attention`` registers them).

- ``"pallas"``: the compiled kernels (Triton backend) on a GPU. Its ``check`` refuses,
  at engine start, a machine whose JAX backend is not a GPU (naming ``"pallas-interpret"``
  and ``"reference"``): interpret mode is 100-1000x slower than the reference, which a
  user asking for a fast kernel would not want to get silently.
- ``"pallas-interpret"``: the same kernels in Pallas interpret mode, on any platform;
  for checking the kernels on a CPU, not for speed.

Both honour every :class:`~paged_jax.attention.spec.AttentionSpec` field (scale, sliding
window, logit soft-cap: arguments of both kernels), over float caches or 8-bit ones
(``kv_cache_dtype="int8" | "fp8"``, dequantized inside the kernels). ``decode`` runs the decode kernel,
``prefill`` the prefill kernel (whose rows with one query are decodes). Speculative decoding's
verification rows (a sequence's pending token and its drafts) are query tiles of the prefill kernel
(``verifies_in_tiles``), causal within the tile like any prefill chunk.

This module imports nothing from ``paged_jax.attention`` (that package imports this one to
register the backends): the backend objects follow its protocol by their methods alone.
"""

from __future__ import annotations

import jax

from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.prefill_attention import paged_prefill_attention

# The model's dtypes, and the 8-bit KV caches (``kv_cache_dtype``), which both kernels dequantize.
DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8")


def _auto_partition(S: int, H: int, max_context: int, partition_size: int = 512) -> int | None:
    """vLLM's rule: split only long contexts, and only when the batch alone cannot fill the GPU."""
    if max_context <= partition_size or S * H > 512:
        return None
    return partition_size


class PallasBackend:
    """Decode and prefill through the Pallas kernels; ``interpret``: run them in interpret mode."""

    def __init__(self, interpret: bool):
        self.interpret = interpret
        self.name = "pallas-interpret" if interpret else "pallas"

    spec_fields = frozenset({"sliding_window", "logit_soft_cap"})  # arguments of both kernels
    dtypes = DTYPES
    # A tile padded to the step's tile size costs only its queries: the prefill kernel's programs past a
    # sequence's last query run no loop. One program reads a row's K/V once for its pending token and all
    # its drafts, where a decode row per token would read it once per token.
    verifies_in_tiles = True

    def check(self, spec, dtype: str) -> None:
        if not self.interpret and jax.default_backend() != "gpu":
            raise ValueError(f"attention_backend='pallas' runs compiled Triton kernels and needs a CUDA GPU, but "
                             f"JAX's default backend is {jax.default_backend()!r}; use 'pallas-interpret' to run "
                             "the same kernels in interpret mode (slow, for checking) or 'reference' (plain jnp)")

    def decode(self, q, k_cache, v_cache, meta, spec):
        """q [S, H, D], the newest token of each sequence -> [S, H, D]."""
        block_size = k_cache.shape[1]
        part = _auto_partition(q.shape[0], q.shape[1], meta.block_tables.shape[1] * block_size)
        if part is not None and part % block_size:
            part = None
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, spec.scale,
                                      partition_size=part, interpret=self.interpret,
                                      sliding_window=spec.sliding_window, logit_soft_cap=spec.logit_soft_cap)

    def prefill(self, q, k_cache, v_cache, meta, spec):
        """q [S, Q, H, D], each sequence's new tokens -> [S, Q, H, D]."""
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens,
                                       spec.scale, interpret=self.interpret, sliding_window=spec.sliding_window,
                                       logit_soft_cap=spec.logit_soft_cap)


PALLAS = PallasBackend(interpret=False)
PALLAS_INTERPRET = PallasBackend(interpret=True)
