"""Building blocks shared by the model families (pure functions over arrays)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax import native
from paged_jax.weights import linear, project  # noqa: F401  (model code's matmuls, any weight format)


def rms_norm(x, w, eps, native_norm: bool = False):
    """``w * (x * rsqrt(mean(x ** 2) + eps))`` in float32 over the last axis. ``native_norm`` (the
    config's, set where the engine loads a model for the native CPU kernels): one native operation
    where XLA's CPU backend makes four (:func:`paged_jax.native.rms_norm`), for float32 operands."""
    if native_norm and native.rms_norm_applies(x, w):
        return native.rms_norm(x, w, eps)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


def layer_norm(x, p, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32)).astype(x.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def apply_rope(x, positions, rope):
    """Rotary embedding in transformers' rotate-half layout, on the first ``2 * len(inv_freq)`` dims of
    each head (the rest pass through). x: [T, heads, head_dim]; ``rope``: the config's
    :meth:`~paged_jax.models.config.ModelConfig.rope_frequencies`. With dynamic NTK, ``positions`` is
    the pair ``(positions, rope_lengths)``: each token's position and its rotation length."""
    inv_freq, long_inv_freq, switch, attention_factor, dynamic = rope
    inv = jnp.asarray(inv_freq)[None, :]
    if long_inv_freq is not None:  # longrope: the long set from position ``switch`` on
        inv = jnp.where(positions[:, None] >= switch, jnp.asarray(long_inv_freq)[None, :], inv)
    if dynamic is not None:
        positions, lengths = positions
        inv = jnp.where(lengths[:, None] > dynamic[2], dynamic_ntk_inv_freq(lengths, len(inv_freq), *dynamic), inv)
    freqs = positions.astype(jnp.float32)[:, None] * inv  # [T, rotated / 2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = rotary_tables(emb)
    cos, sin = cos[:, None, :], sin[:, None, :]
    if attention_factor != 1.0:  # yarn, longrope: scaled cos and sin
        cos, sin = cos * attention_factor, sin * attention_factor
    xf = x.astype(jnp.float32)
    rot = emb.shape[-1]
    xr, half = xf[..., :rot], rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos + rotated * sin
    if rot < x.shape[-1]:
        out = jnp.concatenate([out, xf[..., rot:]], axis=-1)
    return out.astype(x.dtype)


def _cos_sin(emb):
    return jnp.cos(emb), jnp.sin(emb)


def _cos_sin_once(emb):
    # A conditional is a boundary XLA's fusion does not cross: its outputs are computed once, as
    # buffers, and the calls of every layer share them (identical conditionals are merged). Both
    # branches are the same, so the predicate (no NaN angle) only keeps XLA from resolving it early.
    return jax.lax.cond(jnp.isnan(emb).any(), _cos_sin, _cos_sin, emb)


def rotary_tables(emb):
    """``cos(emb), sin(emb)`` of the rotary angles ``emb`` [T, rotated]. On a CPU they are computed
    once a step: otherwise XLA fuses both into each consumer, which evaluates them for every head (the
    tables broadcast over heads), for q and k in every layer (a LLaMA 512 wide, 8 layers: 3.4-4.1 ms of
    a 45-ms 48-row decode step in the 16 fusions, 0.25-0.4 ms with the tables computed once,
    ``experiments/profile_decode_step.py --trace``). Elsewhere as written: a GPU's conditional waits on
    the host (what the fused recomputation costs there is not measured)."""
    return jax.lax.platform_dependent(emb, cpu=_cos_sin_once, default=_cos_sin)


def dynamic_ntk_inv_freq(lengths, num_freqs, theta, factor, original_len):
    """[T, num_freqs] inverse frequencies of dynamic NTK for each token's rotation length L (> the
    original context), in float32 and in the order of transformers' ``_compute_dynamic_ntk_parameters``:
    the base becomes theta * (factor * L / original_len - (factor - 1)) ** (dim / (dim - 2))."""
    dim = 2 * num_freqs
    length = lengths.astype(jnp.float32)[:, None]
    base = theta * ((factor * length / original_len) - (factor - 1)) ** (dim / (dim - 2))
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    return 1.0 / (base ** exponents[None, :])


def split_heads(x, num_heads, head_dim):
    return x.reshape(x.shape[0], num_heads, head_dim)
