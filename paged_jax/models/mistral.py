"""Mistral (Mistral 7B v0.1-v0.3, Mixtral's dense cousins): LLaMA's layer with a sliding window on
every layer (``sliding_window``; ``null`` means full attention, as in v0.2 and later)."""

from __future__ import annotations

from paged_jax.errors import ModelLoadError
from paged_jax.models import llama
from paged_jax.models.config import ModelConfig
from paged_jax.models.family import ModelFamily


def config_from_hf(cfg: dict, dt: str, where: str, family: str = "mistral", **extra) -> ModelConfig:
    """``family``, ``extra``: for Mixtral, which reads the same window."""
    if cfg.get("layer_types"):
        # transformers' own Mistral ignores layer_types too (it points such models to Ministral).
        raise ModelLoadError(f"{where}: a {family} config with layer_types (alternating attention) is not "
                             "supported; supported: one sliding_window for every layer, or none")
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    return llama.config_from_hf(cfg, dt, where, family=family, sliding_window=window, **extra)


FAMILY = ModelFamily(
    name="mistral", architectures=("MistralForCausalLM",), model_types=("mistral",),
    config_from_hf=config_from_hf, hf_tensor_shapes=llama.hf_tensor_shapes,
    params_from_hf=llama.params_from_hf, embed=llama.embed, layer=llama.layer, final=llama.final,
    tiny_config=dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=64,
                     intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=False, hidden_act="silu", sliding_window=64),
    tiny_tokens=dict(bos="<s>", eos="</s>", unk="<unk>", pad=None, add_bos=True))
