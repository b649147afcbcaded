"""Building blocks shared by the model families (pure functions over arrays)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.models.weights import linear  # noqa: F401  (model code's one matmul, any weight format)


def rms_norm(x, w, eps):
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


def apply_rope(x, positions, inv_freq: np.ndarray):
    """Rotary embedding, transformers' rotate-half layout. x: [T, heads, head_dim]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def split_heads(x, num_heads, head_dim):
    return x.reshape(x.shape[0], num_heads, head_dim)
