"""ModelFamily: everything paged-jax knows about one model architecture, in one record.

Each family file (``llama.py``, ``qwen2.py``, ...) ends with one ``FAMILY = ModelFamily(...)``
and is listed once in ``paged_jax.models.FAMILIES``. The record holds:

- which ``config.json`` it reads (``architectures``, ``model_types``) and how
  (``config_from_hf(cfg, dtype, where) -> ModelConfig``);
- the Hugging Face tensors it expects (``hf_tensor_shapes(config) -> {name: shape}``) and how they
  become params (``params_from_hf(config, get, lin)``): ``get(name)`` is one tensor,
  ``lin(prefix, parallel)`` a :class:`~paged_jax.weights.DenseLinear` from ``prefix.weight``
  (and ``prefix.bias`` when present), ``parallel`` its tensor-parallel role;
- the forward: ``embed(params, config, ids, positions)``, ``layer(layer_params, config, h, positions,
  kv, attn)`` (which calls ``attn(q, k, v, kv)``; with dynamic-NTK RoPE ``positions`` is the pair that
  ``apply_rope`` takes), ``final(params, config, h)``;
- a small configuration and tokenizer specials for ``paged-jax make-tiny`` (``tiny_config``,
  ``tiny_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    config_from_hf: Callable
    hf_tensor_shapes: Callable
    params_from_hf: Callable
    embed: Callable
    layer: Callable
    final: Callable
    tiny_config: dict
    tiny_tokens: dict  # bos, eos, unk, pad (or None), add_bos
