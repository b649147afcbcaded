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
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.15)),
}
FAMILY_OF = {"LlamaConfig": "llama", "OPTConfig": "opt", "GPT2Config": "gpt2", "Qwen2Config": "qwen2",
             "MistralConfig": "mistral", "Qwen3Config": "qwen3",
             "Gemma2Config": "gemma2", "Phi3Config": "phi3"}


def make_hf_model(variant: str, out: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from paged_jax.models.tiny import SPECIAL_TOKENS, train_tokenizer

    cls_name, kw = HF_VARIANTS[variant]
    family = FAMILY_OF[cls_name]
    tok = train_tokenizer(family)
    sp = SPECIAL_TOKENS[family]
    ids = dict(bos_token_id=tok.token_to_id(sp["bos"]), eos_token_id=tok.token_to_id(sp["eos"]))
    if sp["pad"]:
        ids["pad_token_id"] = tok.token_to_id(sp["pad"])
    config = getattr(transformers, cls_name)(vocab_size=tok.get_vocab_size(), **ids, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if family in ("llama", "opt", "qwen2", "mistral", "qwen3", "gemma2", "phi3"):
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
