"""ModelConfig: the frozen, hashable description of a model that jit sees as static.

Built from a Hugging Face ``config.json`` by the family that claims its architecture
(``paged_jax.models.FAMILIES``; each family file parses its own fields). The families
share one dataclass; the fields a family does not use keep their defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np

from paged_jax.attention.spec import AttentionSpec
from paged_jax.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
          "float": "float32"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class RopeFrequencies(NamedTuple):
    """What :func:`~paged_jax.models.layers.apply_rope` needs: see :meth:`ModelConfig.rope_frequencies`."""

    inv_freq: np.ndarray
    long_inv_freq: Optional[np.ndarray] = None
    switch: int = 0
    attention_factor: float = 1.0
    dynamic: Optional[tuple[float, float, int]] = None  # dynamic NTK: (rope_theta, factor, original context)


@dataclass(frozen=True)
class ModelConfig:
    family: str  # a key of paged_jax.models.FAMILIES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    activation: str  # "silu" | "relu" | "gelu_new" | ...
    tie_word_embeddings: bool
    dtype: str = "float32"
    # LLaMA
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple[tuple[str, Any], ...]] = None  # sorted items, hashable
    sliding_rope_theta: Optional[float] = None  # the sliding-window layers' own RoPE base, unscaled (Gemma 3)
    attention_bias: bool = False
    mlp_bias: bool = False
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: Optional[int] = None
    enable_bias: bool = True
    has_final_layer_norm: bool = True
    # Attention variants (None: plain causal attention, scale 1/sqrt(head_dim))
    sliding_window: Optional[int] = None
    # Per layer "full_attention" | "sliding_attention" (None: sliding_window, if set, applies to every layer)
    layer_types: Optional[tuple[str, ...]] = None
    attn_logit_softcap: Optional[float] = None
    attention_sinks: bool = False  # a learned sink logit per head in every softmax (gpt-oss; AttentionSpec.sinks)
    attention_scale: Optional[float] = None
    final_logit_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # Mixture-of-experts layers: a paged_jax.models.moe.MoEConfig (None: dense)
    moe: Optional[Any] = None
    kv_cache_dtype: str = "auto"  # "bfloat16", "int8" | "fp8": the engine's KV cache (paged_jax.attention.kv_quant)
    native_norm: bool = False  # RMS norms in the native CPU kernel (set where the engine loads the model)
    # Token ids
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[tuple[int, ...]] = field(default=None)

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def attention_spec(self, layer: int) -> AttentionSpec:
        """What attention layer ``layer`` computes (scale, window, soft-cap), handed to the backend."""
        window = self.sliding_window
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            window = None
        return AttentionSpec(self.softmax_scale, window, self.attn_logit_softcap, sinks=self.attention_sinks)

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling or ()).get("rope_type", "default")

    @property
    def context_limit(self) -> int:
        """The longest max_model_len: max_position_embeddings, which dynamic NTK stretches by its factor
        (vLLM's rule; for transformers it is the original context the scaling starts from)."""
        if self.rope_type == "dynamic":
            return int(self.max_position_embeddings * dict(self.rope_scaling)["factor"])
        return self.max_position_embeddings

    def rope_frequencies(self) -> RopeFrequencies:
        """RoPE as transformers computes it.

        ``inv_freq`` has one entry per rotated pair (``partial_rotary_factor`` of the head rotated);
        ``attention_factor`` scales cos and sin (yarn, longrope). ``longrope`` has a second set,
        ``long_inv_freq``, for positions from ``switch`` (``original_max_position_embeddings``) on: each
        token's rotation depends on its position alone, so prefix caching, chunked prefill and
        preemption give the same keys. (transformers picks one set per forward call, by its longest
        position, and recomputes the cache when a sequence crosses over; the same tokens as here
        while a sequence stays within the original context.)

        ``dynamic`` (NTK) keeps ``inv_freq`` for sequences within ``max_position_embeddings`` (its
        original context) and otherwise raises the base, per token, for the token's rotation length
        L (``apply_rope``). transformers recomputes the frequencies in each forward call for that call's
        longest position (``dynamic_rope_update``): ``generate`` runs the prompt in one call and each new
        token in its own, and cached keys keep the rotation they were made with, so a token at position
        p of a request whose prompt has P tokens is rotated for L = max(P, p + 1), whatever the chunking,
        batching or preemption here. (Its module state, ``max_seq_len_cached`` and the reset below
        ``original_max_seq_len``, only recomputes when L grows and resets when a call is shorter than
        the original context: within one request L never shrinks, so a fresh model gives exactly
        this; a model reused across requests can keep a longer earlier request's frequencies.)"""
        scaling = dict(self.rope_scaling or ())
        kind = scaling.get("rope_type", "default")
        dim = int(self.head_dim * scaling.get("partial_rotary_factor", 1.0))
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
        inv = (1.0 / (self.rope_theta ** exponents)).astype(np.float32)
        long_inv, switch, attention, dynamic = None, 0, 1.0, None
        if kind == "linear":
            inv = inv / np.float32(scaling["factor"])
        elif kind == "llama3":
            factor = scaling["factor"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        elif kind == "yarn":
            inv, attention = _yarn(scaling, self.rope_theta, dim, self.max_position_embeddings)
        elif kind == "longrope":
            old_len = scaling["original_max_position_embeddings"]
            factor = scaling.get("factor") or self.max_position_embeddings / old_len
            attention = scaling.get("attention_factor") or (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len)))
            base = (self.rope_theta ** exponents).astype(np.float32)
            inv = (1.0 / (np.asarray(scaling["short_factor"], np.float32) * base)).astype(np.float32)
            long_inv = (1.0 / (np.asarray(scaling["long_factor"], np.float32) * base)).astype(np.float32)
            switch = int(old_len)
        elif kind == "dynamic":
            dynamic = (float(self.rope_theta), float(scaling["factor"]), int(self.max_position_embeddings))
        return RopeFrequencies(inv, long_inv, switch, float(attention), dynamic)

    @property
    def kv_bytes_per_token(self) -> int:
        from paged_jax.attention.kv_quant import bytes_per_token_head

        per_head = bytes_per_token_head(self.head_dim, self.kv_cache_dtype, DTYPE_BYTES[self.dtype])
        return 2 * self.num_layers * self.num_kv_heads * per_head


def resolve_dtype(requested: str, config_dict: dict) -> str:
    """'auto' -> the config's torch_dtype (float32 when absent); names are normalised."""
    if requested is None:
        requested = "auto"
    requested = str(requested).replace("torch.", "")
    if requested == "auto":
        found = config_dict.get("torch_dtype") or config_dict.get("dtype") or "float32"
        found = str(found).replace("torch.", "")
        if found not in DTYPES:
            raise ModelLoadError(f"config.json has torch_dtype={found!r}; supported: float32, bfloat16, float16")
        return DTYPES[found]
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got {requested!r}")
    return DTYPES[requested]


def require(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise ModelLoadError(f"{where}: config.json lacks required field {key!r}")
    return cfg[key]


LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer_types values paged-jax reads


def check_layer_types(layer_types, num_layers: int, where: str) -> tuple:
    """``layer_types`` (one of :data:`LAYER_TYPES` per layer) as a tuple, or ModelLoadError."""
    if len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_TYPES):
        raise ModelLoadError(f"{where}: layer_types must list one of {LAYER_TYPES} per layer ({num_layers}), "
                             f"got {layer_types!r}")
    return tuple(layer_types)


def eos_tuple(value) -> Optional[tuple[int, ...]]:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _yarn(scaling: dict, theta: float, dim: int, max_positions: int) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies (a ramp between interpolated and original ones) and its attention factor."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / old_len

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention)


def rope_from_hf(cfg: dict, where: str) -> tuple[float, Optional[tuple]]:
    # transformers >= 5 writes rope_parameters; older configs use rope_theta + rope_scaling.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = dict(params)
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope type {kind!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    scaling.pop("rope_theta", None)
    scaling.pop("type", None)
    scaling["rope_type"] = kind
    if "partial_rotary_factor" in cfg:  # a top-level field in some configs (Phi-3)
        scaling.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if cfg.get("original_max_position_embeddings") is not None:  # likewise (Phi-3's longrope)
        scaling.setdefault("original_max_position_embeddings", cfg["original_max_position_embeddings"])
    partial = float(scaling.get("partial_rotary_factor", 1.0) or 1.0)
    if not 0 < partial <= 1:
        raise ModelLoadError(f"{where}: partial_rotary_factor must be in (0, 1], got {partial}")
    if kind == "default" and partial == 1.0:
        return theta, None
    needed = {"default": [], "linear": ["factor"], "dynamic": ["factor"],
              "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
              "yarn": ["original_max_position_embeddings"],
              "longrope": ["short_factor", "long_factor", "original_max_position_embeddings"]}[kind]
    for k in needed:
        if scaling.get(k) is None:
            raise ModelLoadError(f"{where}: rope scaling {kind!r} needs {k!r}; got {sorted(scaling)}")
    kept = {k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()
            if isinstance(v, (int, float, str, list)) and not isinstance(v, bool) or k == "truncate"}
    return theta, tuple(sorted(kept.items()))
