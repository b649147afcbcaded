"""Tiny random models made with transformers (from_config + save_pretrained): the oracle's side."""

from __future__ import annotations

from pathlib import Path

# variant -> (config class name, kwargs). Larger-than-default init so greedy choices are well separated.
HF_VARIANTS = {
    "llama_gqa": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rope_theta=10000.0, initializer_range=0.15, tie_word_embeddings=False)),
    "llama_tied_scaled": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                              max_position_embeddings=512, initializer_range=0.15,
                                              tie_word_embeddings=True, attention_bias=True,
                                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 64})),
    "opt_pre": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=512, word_embed_proj_dim=64, do_layer_norm_before=True,
                                  init_std=0.15)),
    "opt_post": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                   max_position_embeddings=512, word_embed_proj_dim=32, do_layer_norm_before=False,
                                   init_std=0.15)),
    "qwen2_untied": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         initializer_range=0.15, tie_word_embeddings=False)),
    # layer 1 attends through a 5-token window (max_window_layers=1), layer 0 to everything
    "qwen2_tied_window": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=1,
                                              max_position_embeddings=512, initializer_range=0.15,
                                              tie_word_embeddings=True, use_sliding_window=True,
                                              sliding_window=5, max_window_layers=1)),
    # every layer attends through a 6-token window
    "mistral_window": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=2048, initializer_range=0.15,
                                             tie_word_embeddings=False, sliding_window=6)),
    # head_dim 32 with 4 heads over hidden 64; layer 1 attends through a 7-token window
    "qwen3_window": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=512, initializer_range=0.15,
                                         tie_word_embeddings=True, use_sliding_window=True, sliding_window=7,
                                         max_window_layers=1)),
    # layer 0 attends through a 6-token window, layer 1 to everything; soft-caps small enough to bite
    "gemma2": ("Gemma2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    query_pre_attn_scalar=24, max_position_embeddings=512, initializer_range=0.15,
                                    sliding_window=6, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # YaRN, factor 4 over an original context of 32: the prompts plus 32 new tokens cross it
    "llama_yarn": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       initializer_range=0.15, tie_word_embeddings=False,
                                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                                     "original_max_position_embeddings": 32})),
    # fused qkv / gate_up; longrope with short factors over an original context of 64 (the tests stay within
    # it: see ModelConfig.rope_frequencies), a quarter of each head not rotated
    "phi3_longrope": ("Phi3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         original_max_position_embeddings=64, initializer_range=0.15,
                                         tie_word_embeddings=False, partial_rotary_factor=0.75,
                                         rope_scaling={"type": "longrope",
                                                       "short_factor": [1.0 + 0.2 * i for i in range(6)],
                                                       "long_factor": [3.0 + 0.5 * i for i in range(6)]})),
    # dynamic NTK, factor 4 over an original context of 64 (max_position_embeddings): prompts and
    # generations cross it (tests/test_rope_dynamic.py)
    "llama_dynamic": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          initializer_range=0.15, tie_word_embeddings=False,
                                          rope_scaling={"rope_type": "dynamic", "factor": 4.0})),
    "qwen2_dynamic": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          initializer_range=0.15, tie_word_embeddings=True,
                                          rope_scaling={"type": "dynamic", "factor": 3.0})),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.15)),
    # Long-prompt variants (tests/test_long_prompts.py): room for 4,096 positions.
    # llama3 RoPE over an original context of 1,024: with head_dim 32 (wavelengths 2*pi*10000^(i/16)),
    # frequencies 0-6 keep their wavelength (< 256), 7-8 are smoothed and 9-15 are divided by 8, so
    # prompts of 3,000+ tokens sit far beyond the original context in all three regimes.
    "llama_long_llama3": ("LlamaConfig", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=4096, rope_theta=10000.0,
                                              initializer_range=0.15, tie_word_embeddings=False,
                                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 1024})),
    "opt_long": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                   max_position_embeddings=4096, word_embed_proj_dim=64,
                                   do_layer_norm_before=True, init_std=0.15)),
    "gpt2_long": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=4096, initializer_range=0.15)),
}
# Variants only their own family's tests use (tests/test_moe.py, tests/test_gemma3.py), not every
# test parametrized over HF_VARIANTS.
FAMILY_VARIANTS = {
    # 4 experts, top-2 renormalised, on both layers
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.15,
                                      tie_word_embeddings=False, sliding_window=None)),
    # top-2 of 4 not renormalised, plus the shared expert behind its sigmoid gate
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=512,
                                         initializer_range=0.15, tie_word_embeddings=False)),
    # top-2 of 8 renormalised on layer 0; layer 1 is a dense MLP (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         mlp_only_layers=[1], num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                         initializer_range=0.15, tie_word_embeddings=False)),
    # five layers attend through a 6-token window, the sixth to everything; the global layers' RoPE
    # linearly scaled (as on the larger Gemma 3 models), the windowed ones' on their own base
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        query_pre_attn_scalar=24, sliding_window=6, max_position_embeddings=512,
                                        initializer_range=0.15,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
}
FAMILY_OF = {"LlamaConfig": "llama", "OPTConfig": "opt", "GPT2Config": "gpt2", "Qwen2Config": "qwen2",
             "MistralConfig": "mistral", "Qwen3Config": "qwen3",
             "Gemma2Config": "gemma2", "Phi3Config": "phi3", "MixtralConfig": "mixtral",
             "Qwen2MoeConfig": "qwen2_moe", "Qwen3MoeConfig": "qwen3_moe", "Gemma3TextConfig": "gemma3"}


def make_hf_model(variant: str, out: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from paged_jax.models.tiny import SPECIAL_TOKENS, train_tokenizer

    cls_name, kw = {**HF_VARIANTS, **FAMILY_VARIANTS}[variant]
    family = FAMILY_OF[cls_name]
    tok = train_tokenizer(family)
    sp = SPECIAL_TOKENS[family]
    ids = dict(bos_token_id=tok.token_to_id(sp["bos"]), eos_token_id=tok.token_to_id(sp["eos"]))
    if sp["pad"]:
        ids["pad_token_id"] = tok.token_to_id(sp["pad"])
    config = getattr(transformers, cls_name)(vocab_size=tok.get_vocab_size(), **ids, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if family != "gpt2":
        # HF initialises norms to ones/biases to zeros; perturb them so the test sees they are loaded.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=sp["bos"], eos_token=sp["eos"],
                                                unk_token=sp["unk"], pad_token=sp["pad"])
    fast.save_pretrained(out)
    return Path(out)


def load_hf(path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    return model


# compressed-tensors schemes for quantized fixtures: name -> (preset, changes to its weight args);
# preset None: fp8 weights alone (no activation quantization). Group and block sizes are small
# enough for the tiny models' 64-wide layers.
CT_SCHEMES = {
    "W4A16": ("W4A16", dict(group_size=32)),
    "W4A16_ASYM": ("W4A16_ASYM", dict(group_size=32)),  # packed zero points
    "W8A16": ("W8A16", dict(group_size=32)),
    "W8A8": ("W8A8", {}),  # int8 weights per channel, int8 activations per token
    "FP8_DYNAMIC": ("FP8_DYNAMIC", {}),  # fp8 weights per channel, fp8 activations per token
    "FP8_BLOCK": ("FP8_BLOCK", dict(block_structure=[32, 32])),  # activations per group of 128: refused
    "FP8_TENSOR_W": (None, dict(strategy="tensor")),
    "FP8_BLOCK_W": (None, dict(strategy="block", block_structure=[32, 32])),
}


def _set_weight_qparams(module) -> None:
    """Scales and zero points from the weight's own min / max (the calibration llm-compressor does)."""
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.data.float()
    out, inp = w.shape
    if args.strategy == S.TENSOR:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == S.CHANNEL:
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == S.GROUP:
        g = w.reshape(out, inp // args.group_size, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        bo, bi = args.block_structure
        b = w.reshape(out // bo, bo, inp // bi, bi)
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    scale, zero = calculate_qparams(lo, hi, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def make_ct_model(variant: str, scheme: str, out: Path, ignore=("lm_head",), seed: int = 0) -> Path:
    """A tiny random model of ``variant`` quantized by compressed-tensors with ``scheme`` (see
    CT_SCHEMES) and saved compressed, as llm-compressor saves one; its float original beside it
    (``<out>-float``)."""
    out = Path(out)
    src = make_hf_model(variant, out.parent / (out.name + "-float"), seed=seed)
    return quantize_ct(src, scheme, out, ignore)


def quantize_ct(src: Path, scheme: str, out: Path, ignore=("lm_head",), **weight_changes) -> Path:
    """The float HF folder ``src`` quantized by compressed-tensors with ``scheme`` (CT_SCHEMES, its
    weight args changed by ``weight_changes``), saved compressed into ``out`` with the tokenizer."""
    import shutil

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    src, out = Path(src), Path(out)
    model = load_hf(src)
    preset, changes = CT_SCHEMES[scheme]
    changes = {**changes, **weight_changes}
    if preset is None:
        qs = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float",
                                                                            symmetric=True, **changes))
    else:
        qs = preset_name_to_scheme(preset, ["Linear"])
        for k, v in changes.items():
            setattr(qs.weights, k, v)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qs}, ignore=list(ignore)))
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            _set_weight_qparams(m)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out)
    return out


def ct_dequantized_model(path):
    """The float model compressed-tensors' own decompressors make of a quantized folder (weights
    dequantized; activations not quantized): what the numpy oracle (tests/ct_numpy.py) is checked against."""
    return float_model(path, ct_decompressed_tensors(path))


def ct_decompressed_tensors(path) -> dict:
    """Every tensor of a quantized folder, name -> torch tensor, the quantized weights as
    compressed-tensors' own decompressors give them (float)."""
    import json
    from collections import defaultdict

    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    path = Path(path)
    qc = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = next(iter(qc.config_groups.values()))
    state = load_file(str(path / "model.safetensors"))
    modules, floats = defaultdict(dict), {}
    for k, v in state.items():
        module, _, leaf = k.rpartition(".")
        if leaf.startswith("weight_") or (leaf == "weight" and module + ".weight_scale" in state):
            modules[module][leaf] = v
        else:
            floats[k] = v
    decompressor = BaseCompressor.load_from_registry(scheme.format or qc.format)
    for module, tensors in modules.items():
        floats[module + ".weight"] = decompressor.decompress(tensors, scheme)["weight"].float()
    return floats


def float_model(path, floats):
    """The transformers float32 model of the quantized folder ``path`` holding the float tensors
    ``floats`` (name -> torch tensor; a tied LM head may be missing)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(floats, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval()
