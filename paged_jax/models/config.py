"""ModelConfig: the frozen, hashable description of a model that jit sees as static.

Built from a Hugging Face ``config.json``. The three supported families share
one dataclass; the fields a family does not use keep their defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from paged_jax.attention.spec import AttentionSpec
from paged_jax.errors import ModelLoadError

# architecture name in config.json -> family
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "OPTForCausalLM": "opt",
    "GPT2LMHeadModel": "gpt2",
}
MODEL_TYPE_TO_FAMILY = {"llama": "llama", "opt": "opt", "gpt2": "gpt2"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
          "float": "float32"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "opt" | "gpt2"
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
    attention_bias: bool = False
    mlp_bias: bool = False
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: Optional[int] = None
    enable_bias: bool = True
    has_final_layer_norm: bool = True
    # Attention variants (None: plain causal attention, scale 1/sqrt(head_dim))
    sliding_window: Optional[int] = None
    attn_logit_softcap: Optional[float] = None
    attention_scale: Optional[float] = None
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
        return AttentionSpec(self.softmax_scale, self.sliding_window, self.attn_logit_softcap)

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse rotary frequencies, as transformers computes them (float32)."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
        inv = inv.astype(np.float32)
        scaling = dict(self.rope_scaling or ())
        kind = scaling.get("rope_type", "default")
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
        return inv

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


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


def _require(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise ModelLoadError(f"{where}: config.json lacks required field {key!r}")
    return cfg[key]


def _eos_tuple(value) -> Optional[tuple[int, ...]]:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def family_of(cfg: dict, where: str) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if archs:
        raise ModelLoadError(
            f"{where}: unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    model_type = cfg.get("model_type")
    if model_type in MODEL_TYPE_TO_FAMILY:
        return MODEL_TYPE_TO_FAMILY[model_type]
    raise ModelLoadError(
        f"{where}: unsupported model_type {model_type!r} (no 'architectures' given); "
        f"supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}")


def model_config_from_hf(cfg: dict, dtype: str = "auto", where: str = "model") -> ModelConfig:
    """Translate a parsed config.json into a ModelConfig, with clear errors."""
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{where}: config.json must hold a JSON object, got {type(cfg).__name__}")
    family = family_of(cfg, where)
    dt = resolve_dtype(dtype, cfg)
    try:
        if family == "llama":
            return _llama(cfg, dt, where)
        if family == "opt":
            return _opt(cfg, dt, where)
        return _gpt2(cfg, dt, where)
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{where}: malformed config.json: {e}") from e


def _rope(cfg: dict, where: str) -> tuple[float, Optional[tuple]]:
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
    if kind == "default":
        return theta, None
    needed = {"linear": ["factor"],
              "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]}[kind]
    for k in needed:
        if k not in scaling:
            raise ModelLoadError(f"{where}: rope scaling {kind!r} needs {k!r}; got {sorted(scaling)}")
    return theta, tuple(sorted((k, v) for k, v in scaling.items() if isinstance(v, (int, float, str))))


def _llama(cfg: dict, dt: str, where: str) -> ModelConfig:
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{where}: hidden_act {act!r} is not supported for LLaMA; supported: ['silu']")
    if int(cfg.get("pretraining_tp", 1)) != 1:
        raise ModelLoadError(f"{where}: pretraining_tp={cfg['pretraining_tp']} is not supported; supported: 1")
    theta, scaling = _rope(cfg, where)
    return ModelConfig(
        family="llama", vocab_size=int(_require(cfg, "vocab_size", where)), hidden_size=hidden,
        num_layers=int(_require(cfg, "num_hidden_layers", where)), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=int(_require(cfg, "intermediate_size", where)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), activation="silu",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), dtype=dt,
        rope_theta=theta, rope_scaling=scaling, attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=_eos_tuple(cfg.get("eos_token_id")))


def _opt(cfg: dict, dt: str, where: str) -> ModelConfig:
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    act = cfg.get("activation_function", "relu")
    if act not in ("relu", "gelu", "gelu_new"):
        raise ModelLoadError(f"{where}: activation_function {act!r} is not supported for OPT; supported: relu, gelu, gelu_new")
    if not cfg.get("layer_norm_elementwise_affine", True):
        raise ModelLoadError(f"{where}: layer_norm_elementwise_affine=False is not supported")
    proj = cfg.get("word_embed_proj_dim")
    before = bool(cfg.get("do_layer_norm_before", True))
    return ModelConfig(
        family="opt", vocab_size=int(_require(cfg, "vocab_size", where)), hidden_size=hidden,
        num_layers=int(_require(cfg, "num_hidden_layers", where)), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=int(_require(cfg, "ffn_dim", where)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)), norm_eps=1e-5,
        activation=act, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), dtype=dt,
        do_layer_norm_before=before,
        word_embed_proj_dim=int(proj) if proj is not None and int(proj) != hidden else None,
        enable_bias=bool(cfg.get("enable_bias", True)),
        has_final_layer_norm=before and not cfg.get("_remove_final_layer_norm", False),
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=_eos_tuple(cfg.get("eos_token_id")))


def _gpt2(cfg: dict, dt: str, where: str) -> ModelConfig:
    hidden = int(cfg.get("n_embd", cfg.get("hidden_size", 768)))
    heads = int(cfg.get("n_head", cfg.get("num_attention_heads", 12)))
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu", "relu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"{where}: activation_function {act!r} is not supported for GPT-2")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(flag):
            raise ModelLoadError(f"{where}: GPT-2 option {flag}=True is not supported")
    if cfg.get("scale_attn_weights", True) is False:
        raise ModelLoadError(f"{where}: GPT-2 option scale_attn_weights=False is not supported")
    inner = cfg.get("n_inner")
    return ModelConfig(
        family="gpt2", vocab_size=int(_require(cfg, "vocab_size", where)), hidden_size=hidden,
        num_layers=int(cfg.get("n_layer", cfg.get("num_hidden_layers", 12))), num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=int(inner) if inner else 4 * hidden,
        max_position_embeddings=int(cfg.get("n_positions", cfg.get("max_position_embeddings", 1024))),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), activation=act,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), dtype=dt,
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=_eos_tuple(cfg.get("eos_token_id")))
