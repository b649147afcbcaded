"""Qwen2 (Qwen1.5, Qwen2, Qwen2.5): LLaMA's layer with a bias on the Q/K/V projections (none on the
output projection), tied or untied embeddings, and optionally a sliding window on the layers
from ``max_window_layers`` on (``use_sliding_window``), as transformers' ``layer_types`` says."""

from __future__ import annotations

import functools

from paged_jax.errors import ModelLoadError
from paged_jax.models import llama
from paged_jax.models.config import ModelConfig, check_layer_types
from paged_jax.models.family import ModelFamily

def config_from_hf(cfg: dict, dt: str, where: str, family: str = "qwen2") -> ModelConfig:
    """``family``: Qwen3 reads the same fields."""
    num_layers = int(cfg.get("num_hidden_layers", 0))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    layer_types = None
    if window is not None:
        window = int(window)
        if window < 1:
            raise ModelLoadError(f"{where}: sliding_window must be a positive integer, got {window}")
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", num_layers)) else "full_attention"
            for i in range(num_layers)]
        layer_types = check_layer_types(layer_types, num_layers, where)
    return llama.config_from_hf(cfg, dt, where, family=family, sliding_window=window, layer_types=layer_types)


# The same tensors as LLaMA's, with Q/K/V biases and no output-projection bias.
hf_tensor_shapes = functools.partial(llama.hf_tensor_shapes, qkv_bias=True, o_bias=False)

FAMILY = ModelFamily(
    name="qwen2", architectures=("Qwen2ForCausalLM",), model_types=("qwen2",),
    config_from_hf=config_from_hf, hf_tensor_shapes=hf_tensor_shapes,
    # the loader's ``lin`` picks the biases up where the checkpoint has them: LLaMA's code as it is
    params_from_hf=llama.params_from_hf, embed=llama.embed, layer=llama.layer, final=llama.final,
    tiny_config=dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
                     intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False),
    tiny_tokens=dict(bos="<|endoftext|>", eos="<|endoftext|>", unk="<unk>", pad=None, add_bos=False))
