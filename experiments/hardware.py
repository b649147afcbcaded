"""GPUs, model shapes and the paper's serving setups (Table 1), for the simulator.

Model shapes are the project's own :class:`ModelConfig`, built from the
Hugging Face ``config.json`` fields of each model (no weights). The KV cache of
each setup holds the number of token slots Table 1 gives.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

from paged_jax.models import ModelConfig, model_config_from_hf

GIB = 1 << 30


@dataclass(frozen=True)
class GPUProfile:
    """Peak rates of one GPU (A100 SXM data sheet) and the fraction a real kernel reaches."""

    name: str
    memory_bytes: float
    peak_flops: float  # dense fp16 tensor-core FLOP/s
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per direction, per GPU
    pcie_bandwidth: float  # bytes/s achieved host <-> device
    matmul_efficiency: float = 0.5  # fraction of peak FLOP/s a GEMM reaches
    bandwidth_efficiency: float = 0.7  # fraction of peak HBM bandwidth a memory-bound kernel reaches


A100_40GB = GPUProfile("A100-40GB", 40e9, 312e12, 1.555e12, 300e9, 25e9)
A100_80GB = GPUProfile("A100-80GB", 80e9, 312e12, 2.039e12, 300e9, 25e9)


def _opt(hidden: int, layers: int, heads: int) -> ModelConfig:
    return model_config_from_hf({
        "architectures": ["OPTForCausalLM"], "vocab_size": 50272, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "ffn_dim": 4 * hidden,
        "max_position_embeddings": 2048, "activation_function": "relu", "torch_dtype": "float16"}, where="OPT")


MODELS: dict[str, ModelConfig] = {
    "opt-13b": _opt(5120, 40, 40),
    "opt-66b": _opt(9216, 64, 72),
    "opt-175b": _opt(12288, 96, 96),
    "llama-13b": model_config_from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 5120,
        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
        "intermediate_size": 13824, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "torch_dtype": "float16"}, where="LLaMA"),
    # Gemma 3 12B's text model (google/gemma-3-12b-it's text_config): 40 windowed layers (1,024 tokens)
    # and 8 global ones, five to one; with layer groups the windowed ones keep a window's blocks.
    "gemma3-12b": model_config_from_hf({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
        "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16"}, where="Gemma 3"),
}


def num_params(m: ModelConfig) -> int:
    """Weights read per forward pass: attention and MLP of every layer plus the LM head."""
    h = m.hidden_size
    mlp = (2 if m.family in ("opt", "gpt2") else 3) * h * m.intermediate_size  # the others gate (SwiGLU, GeGLU)
    attn = 2 * h * m.num_heads * m.head_dim + 2 * h * m.num_kv_heads * m.head_dim
    return m.num_layers * (attn + mlp) + m.vocab_size * h


@dataclass(frozen=True)
class Setup:
    """A model served on ``num_gpus`` GPUs (tensor parallel) with a KV cache of ``kv_slots`` tokens."""

    name: str
    model: ModelConfig
    gpu: GPUProfile
    num_gpus: int
    kv_slots: int  # Table 1: max KV cache slots
    swap_bytes: float = 20 * GIB  # the paper's swap space

    def num_gpu_blocks(self, block_size: int) -> int:
        """Physical blocks for the KV pool at this block size (plus the reserved null block)."""
        return self.kv_slots // block_size + 1

    def num_cpu_blocks(self, block_size: int) -> int:
        return int(self.swap_bytes // (self.model.kv_bytes_per_token * block_size))


SETUPS: dict[str, Setup] = {
    "opt-13b": Setup("OPT-13B, 1xA100-40GB", MODELS["opt-13b"], A100_40GB, 1, 15_700),
    "opt-66b": Setup("OPT-66B, 4xA100-40GB", MODELS["opt-66b"], A100_40GB, 4, 9_700),
    "opt-175b": Setup("OPT-175B, 8xA100-80GB", MODELS["opt-175b"], A100_80GB, 8, 60_100),
    # Not in Table 1: LLaMA-13B (shared-prefix experiment) has OPT-13B's KV size per token; same GPU and pool.
    "llama-13b": Setup("LLaMA-13B, 1xA100-40GB", MODELS["llama-13b"], A100_40GB, 1, 15_700),
}


def slots_in_memory(model: ModelConfig, gpu: GPUProfile, utilization: float = 0.9,
                    activations: float = 2 * GIB) -> int:
    """KV token slots (every layer's K/V, one pool) left in ``utilization`` of the GPU's memory by the
    16-bit weights and ``activations`` (vLLM's ``gpu_memory_utilization`` sizing)."""
    return int((utilization * gpu.memory_bytes - 2 * num_params(model) - activations) // model.kv_bytes_per_token)


# Not in Table 1: Gemma 3 12B (text) on one A100-80GB, its pool sized as vLLM sizes it.
SETUPS["gemma3-12b"] = Setup("Gemma 3 12B, 1xA100-80GB", MODELS["gemma3-12b"], A100_80GB, 1,
                             slots_in_memory(MODELS["gemma3-12b"], A100_80GB))


def with_kv_cache(setup: Setup, kv_cache_dtype: str, name: str) -> Setup:
    """``setup`` with its KV cache stored as ``kv_cache_dtype`` (``"int8"`` / ``"fp8"``: one byte per
    value plus a 2-byte scale per token and head, paged_jax.attention.kv_quant) in the same memory:
    the slots grow by the ratio of bytes per token, and every K/V read is that much smaller."""
    model = dataclasses.replace(setup.model, kv_cache_dtype=kv_cache_dtype)
    slots = int(setup.kv_slots * setup.model.kv_bytes_per_token / model.kv_bytes_per_token)
    return dataclasses.replace(setup, name=name, model=model, kv_slots=slots)


# Beyond the paper: OPT-13B with an 8-bit KV cache in the 16-bit cache's memory.
SETUPS["opt-13b-kv8"] = with_kv_cache(SETUPS["opt-13b"], "int8", "OPT-13B, 8-bit KV, 1xA100-40GB")


def get_setup(name: str) -> Setup:
    if name not in SETUPS:
        raise ValueError(f"unknown setup {name!r}; choose one of {sorted(SETUPS)}")
    return SETUPS[name]
