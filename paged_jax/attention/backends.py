"""Attention backends as objects, registered by name, and the built-in ones.

A backend has a ``name``, declares what it honours:

- ``spec_fields``: the :class:`AttentionSpec` fields beyond the scale it honours (absent: none).
  :func:`select_backend` refuses, naming the field, a layer whose spec sets a field the backend
  has not declared (:func:`non_default_fields`). A backend declaring ``sinks`` takes the layer's
  sink logits as a keyword argument, ``sinks`` float32 ``[H]``, in each call below (only then);
- ``dtypes``: the cache dtypes it takes (absent: any its ``check`` accepts);
- ``verifies_in_tiles``: True where a query tile costs the backend its real queries, not its
  padded size: speculative decoding then scores a row's pending token and drafts as one query
  tile (absent: as a decode row per token; :func:`paged_jax.executor.draft_rows.drafts_as_rows`);

and has a ``check`` method and either a ragged kernel or a decode and a prefill one:

- ``check(spec, dtype)``: raise ValueError, naming the backend and what it cannot do, when
  it cannot run on this machine (its platform, a library it needs). The engine calls it for
  every layer's spec, after the declarations, before anything is compiled, so a backend never
  meets a spec it refused.
- ``ragged(q, k_cache, v_cache, meta, spec)``: q ``[T, H, D]`` token-flat, sequence ``s``'s
  ``query_lens[s]`` new tokens consecutive and ending at ``last_token[s]``, query ``i`` at
  position ``context_lens[s] - query_lens[s] + i`` -> ``[T, H, D]`` (tokens of no sequence:
  unspecified): a step's decodes and prefill chunks in one call, its queries never padded to
  query tiles. The layer calls only this.
- or ``decode(q, k_cache, v_cache, meta, spec)``: q ``[S, H, D]``, the newest token of each
  sequence (at position ``context_lens[s] - 1``) -> ``[S, H, D]``; and
  ``prefill(q, k_cache, v_cache, meta, spec)``: q ``[S, Q, H, D]``, query ``i`` of sequence
  ``s`` at position ``context_lens[s] - query_lens[s] + i`` -> ``[S, Q, H, D]``. The layer runs
  them through :func:`~paged_jax.attention.split_step.as_ragged`, which splits the step into
  decode rows and query tiles.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` and already hold this step's
K/V; ``meta`` is the step's :class:`AttentionMetadata` (block tables, lengths); outputs are in
q's dtype. Built in: ``"reference"`` (plain jnp), ``"native"`` (the C++ CPU kernel, ragged),
``"pallas"`` and ``"pallas-interpret"`` (``pallas_kernels/backend.py``). A variant of your
own is one file: a :class:`ReferenceBackend` with ``score_mod`` / ``mask_mod`` hooks (or a
class with ``check`` and ``ragged``, or ``decode`` and ``prefill``) and a :func:`register_backend` call
(see ``paged_jax/attention/variants/``).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import jax
import jax.numpy as jnp

from paged_jax.attention.decode import paged_decode_attention
from paged_jax.attention.prefill import blockwise_prefill_attention
from paged_jax.attention.reference import MaskMod, ScoreMod, paged_attention_reference
from paged_jax.attention.spec import ALL_FIELDS, AttentionSpec, non_default_fields

AUTO = "auto"  # the engine's default: "pallas" on a GPU, "native" on a CPU, where they honour the model, else "reference"
# What "auto" tries first, by JAX's default backend: the platform's fast kernels.
AUTO_PREFERENCE = {"gpu": "pallas", "cpu": "native"}
logger = logging.getLogger("paged_jax")
_BACKENDS: dict = {}


def register_backend(backend) -> None:
    """Make ``backend`` available as ``attention_backend=backend.name`` (replacing one of that name)."""
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"a backend's name must be a non-empty string other than {AUTO!r}, got {name!r} "
                         f"(from {backend!r})")
    has = [m for m in ("check", "ragged", "decode", "prefill") if callable(getattr(backend, m, None))]
    if "check" not in has or "ragged" not in has and not {"decode", "prefill"} <= set(has):
        raise ValueError(f"backend {name!r} must have a callable check method and ragged, or decode and prefill; "
                         f"it has {', '.join(has) or 'none of them'}")
    _BACKENDS[name] = backend


def get_backend(name: str):
    """The backend registered as ``name``, unchecked (``select_backend`` checks it against a model)."""
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be {AUTO!r} or one of {available_backends()}, got {name!r}")
    return _BACKENDS[name]


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def select_backend(name: str, specs: Iterable[AttentionSpec], dtype: str, native_kernels: bool = True):
    """The backend an engine runs: ``name``'s, checked against every spec (ValueError if it
    refuses one), or for ``"auto"`` the platform's kernels (:data:`AUTO_PREFERENCE`: Pallas on a
    GPU, native on a CPU unless ``native_kernels`` is False) where they pass their check, else the
    reference. The choice is logged and shown as ``attention_backend`` in the engine's ``get_stats()``."""
    specs = set(specs)
    if name == NATIVE.name and not native_kernels:
        raise ValueError("attention_backend='native' needs the native kernels, which native_kernels=False "
                         "switches off; use 'reference' or 'auto'")
    if name == AUTO:
        platform = jax.default_backend()
        preferred = AUTO_PREFERENCE.get(platform)
        if preferred == NATIVE.name and not native_kernels:
            preferred = None
        if preferred is not None:
            try:
                backend = _checked(get_backend(preferred), specs, dtype)
                logger.info("attention_backend='auto' on %s: running %r", platform, backend.name)
                return backend
            except ValueError as e:
                logger.info("attention_backend='auto' on %s: %s; running 'reference'", platform, e)
        return _checked(REFERENCE, specs, dtype)
    return _checked(get_backend(name), specs, dtype)


def _checked(backend, specs, dtype: str):
    """``backend``, once it passed its declarations and its ``check`` for every spec (else ValueError)."""
    for spec in specs:
        check_declared(backend, spec, dtype)
        backend.check(spec, dtype)
    return backend


def check_declared(backend, spec: AttentionSpec, dtype: str) -> None:
    """ValueError, naming the field or dtype, when ``spec`` or ``dtype`` is beyond what ``backend``
    declares (``spec_fields``, ``dtypes``)."""
    honoured = frozenset(getattr(backend, "spec_fields", ()))
    for field in non_default_fields(spec):
        if field not in honoured:
            raise ValueError(f"attention_backend={backend.name!r} does not honour the model's attention "
                             f"{field}={getattr(spec, field)!r} (it declares {sorted(honoured) or 'no field'} "
                             "beyond the scale); use 'reference', which honours every field")
    dtypes = getattr(backend, "dtypes", None)
    if dtypes is not None and str(dtype) not in dtypes:
        raise ValueError(f"attention_backend={backend.name!r} takes caches of dtype {' / '.join(dtypes)}, "
                         f"got {dtype!r}")


def soft_cap_mod(cap: Optional[float]) -> Optional[ScoreMod]:
    """The reference's ``score_mod`` for logit soft-capping (None: no hook)."""
    return None if cap is None else (lambda s, q_pos, k_pos: cap * jnp.tanh(s / cap))


def window_mask_mod(window: Optional[int]) -> Optional[MaskMod]:
    """The reference's ``mask_mod`` for a sliding window (None: no hook)."""
    return None if window is None else (lambda q_pos, k_pos: k_pos > q_pos - window)


def _chain_scores(first: Optional[ScoreMod], then: Optional[ScoreMod]) -> Optional[ScoreMod]:
    if first is None or then is None:
        return first or then
    return lambda s, q_pos, k_pos: then(first(s, q_pos, k_pos), q_pos, k_pos)


def _both_masks(a: Optional[MaskMod], b: Optional[MaskMod]) -> Optional[MaskMod]:
    if a is None or b is None:
        return a or b
    return lambda q_pos, k_pos: a(q_pos, k_pos) & b(q_pos, k_pos)


class ReferenceBackend:
    """The plain-jnp definition (:func:`paged_attention_reference`), any dtype and platform.

    The spec's soft-cap and window become the reference's ``score_mod`` / ``mask_mod``;
    ``score_mod`` / ``mask_mod`` given here are a researcher's own variant, applied after the
    spec's (the cap, then your score_mod; your mask and the window both must allow a key).
    Prefill runs :func:`blockwise_prefill_attention`: the same function computed blockwise with an
    online softmax, so a long prompt's memory grows linearly with its length (``dense_prefill``
    is the reference itself). A decode step without hooks runs :func:`paged_decode_attention`:
    plain jnp, the same function in the head-major layout XLA's CPU backend runs fastest."""

    spec_fields = ALL_FIELDS  # every field (its hooks), in every dtype

    def __init__(self, name: str = "reference", score_mod: Optional[ScoreMod] = None,
                 mask_mod: Optional[MaskMod] = None):
        self.name, self.score_mod, self.mask_mod = name, score_mod, mask_mod

    def check(self, spec: AttentionSpec, dtype: str) -> None:
        pass  # any platform

    def _hooks(self, spec: AttentionSpec):
        return dict(score_mod=_chain_scores(soft_cap_mod(spec.logit_soft_cap), self.score_mod),
                    mask_mod=_both_masks(window_mask_mod(spec.sliding_window), self.mask_mod))

    def prefill(self, q, k_cache, v_cache, meta, spec: AttentionSpec, sinks=None):
        # Blockwise (online softmax over K/V chunks): memory linear in the prompt, not quadratic.
        # The spec's window is passed as such (not as a hook) so that chunks before it are skipped.
        return blockwise_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_lens,
                                       spec.scale, score_mod=_chain_scores(soft_cap_mod(spec.logit_soft_cap),
                                                                           self.score_mod),
                                       mask_mod=self.mask_mod, sliding_window=spec.sliding_window, sinks=sinks)

    def dense_prefill(self, q, k_cache, v_cache, meta, spec: AttentionSpec, sinks=None):
        """The same prefill through :func:`paged_attention_reference` itself: one ``[Q, L]`` score
        matrix per head (quadratic memory in the prompt). What ``prefill`` ran before it went
        blockwise; kept for comparisons (``experiments/bench_long_prompt.py``)."""
        return paged_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                         meta.query_lens, spec.scale, sinks=sinks, **self._hooks(spec))

    def decode(self, q, k_cache, v_cache, meta, spec: AttentionSpec, sinks=None):
        hooks = self._hooks(spec)
        # A step with prefill tokens has a row per token, most of them empty: the blockwise path
        # reads K/V only up to each group of rows' longest context (none for empty groups), where
        # the decode layout gathers every row's whole table.
        if hooks["score_mod"] is None and hooks["mask_mod"] is None and not meta.num_tiles:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, spec.scale,
                                          sinks=sinks)
        # The layer's decode rows have query_lens 1, or 0 for rows with nothing to attend to (their
        # output is unspecified): as a prefill of one query each, the newest.
        # (sinks passed on only when there are any: a subclass's own prefill need not take them)
        kw = {} if sinks is None else {"sinks": sinks}
        return self.prefill(q[:, None], k_cache, v_cache, meta, spec, **kw)[:, 0]


class NativeBackend:
    """The C++ CPU kernel (``paged_jax/native``, :func:`paged_jax.native.paged_attention`) for a
    whole ragged step.

    float32 or bfloat16 caches, a bfloat16 one beside float32 weights (``kv_cache_dtype="bfloat16"``, its bits in
    uint16) or an 8-bit one (``kv_cache_dtype="int8" | "fp8"``), on a CPU where the
    kernel builds; the spec's sliding window, soft-cap and sinks are the kernel's arguments."""

    name = "native"
    spec_fields = frozenset({"sliding_window", "logit_soft_cap", "sinks"})  # kernel arguments
    dtypes = ("float32", "bfloat16", "int8", "fp8")
    verifies_in_tiles = True  # the kernel sizes each sequence's work to its queries

    def check(self, spec: AttentionSpec, dtype: str) -> None:
        from paged_jax import native

        why = None
        if jax.default_backend() != "cpu":
            why = f"it runs on a CPU, and JAX's default backend is {jax.default_backend()!r}"
        elif not native.available():
            why = f"the native library is not available here ({native.status().get('error', 'PAGED_JAX_NATIVE=0')})"
        if why:
            raise ValueError(f"attention_backend='native' cannot run this model: {why}; use 'reference' or 'auto'")

    def ragged(self, q, k_cache, v_cache, meta, spec: AttentionSpec, sinks=None):
        from paged_jax import native

        starts = meta.last_token - meta.query_lens + 1
        return native.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, starts,
                                      meta.query_lens, spec.scale, spec.sliding_window, spec.logit_soft_cap, sinks)


REFERENCE = ReferenceBackend()
NATIVE = NativeBackend()
