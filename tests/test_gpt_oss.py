"""gpt-oss against transformers, and attention sinks against a numpy oracle.

The model: a tiny ``GptOssForCausalLM`` from ``from_config`` (float32) with its sinks, biases and norms
drawn large enough to matter, a 6-token window on layer 0 (layer 1 sees everything) and
YaRN over an original context of 32: the prompts cross both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.attention_oracle import numpy_attention
from tests.hf_models import load_hf

CONFIG = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128,
              initializer_range=0.15, tie_word_embeddings=False, swiglu_limit=1.5,
              rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                   original_max_position_embeddings=32, rope_theta=10000.0))


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    import transformers

    from paged_jax.models.tiny import SPECIAL_TOKENS, train_tokenizer

    out = tmp_path_factory.mktemp("gpt_oss")
    tok = train_tokenizer("gpt_oss")
    sp = SPECIAL_TOKENS["gpt_oss"]
    config = transformers.GptOssConfig(vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id(sp["bos"]),
                                       eos_token_id=tok.token_to_id(sp["eos"]), **CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):  # sink logits of the order of the heads' scores: they move the softmax
                p.copy_(2.0 * torch.randn_like(p))
            elif "norm" in name or "bias" in name:  # HF starts norms at one and biases at zero
                p.add_(0.1 * torch.randn_like(p))
            elif "experts" in name:  # big enough that the SwiGLU's clamps (1.5) bite
                p.mul_(4.0)
    model.save_pretrained(out)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=sp["bos"], eos_token=sp["eos"],
                                         unk_token=sp["unk"]).save_pretrained(out)
    return out


def _prompts(vocab, sizes=(5, 21, 40), seed=7):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in sizes]


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_gpt_oss_logits_equal_transformers(gpt_oss_dir):
    """Prefill logits of a 40-token prompt (past the 6-token window and YaRN's 32) over 4-token
    blocks equal transformers'. The sinks matter: transformers' own logits move by far more than the
    tolerance without them."""
    from paged_jax.models.loader import load_model
    from tests.model_helpers import PagedRunner

    hf = load_hf(gpt_oss_dir)
    prompts = _prompts(hf.config.vocab_size, sizes=(40,))
    config, params = load_model(gpt_oss_dir)
    assert [config.attention_spec(i).sliding_window for i in range(2)] == [6, None]
    assert all(config.attention_spec(i).sinks for i in range(2))
    from paged_jax import native

    # the engine's own choice on a CPU (the slow tests run the reference and the engine's default)
    backend = "native" if native.available() else "reference"
    ours = PagedRunner(config, params, block_size=4, backend=backend).prefill_logits(prompts)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0].numpy()
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    # the oracle's sensitivity to the sinks: a model without them is far from these logits
    with torch.no_grad():
        sinks = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        without = hf(torch.tensor([prompts[-1]])).logits[0].numpy()
        for layer, s in zip(hf.model.layers, sinks):
            layer.self_attn.sinks.copy_(s)
    assert np.abs(without - ours[-1]).max() > 0.05


@pytest.mark.slow  # about 25 s
def test_gpt_oss_greedy_equals_transformers(gpt_oss_dir):
    """Greedy tokens through the engine (its default backend: native on a CPU where it builds) over
    4-token blocks, the windowed layers' blocks freed, equal transformers'."""
    from paged_jax import LLM, SamplingParams

    hf = load_hf(gpt_oss_dir)
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(str(gpt_oss_dir), block_size=4, max_model_len=96)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, p, 12)


@pytest.mark.slow  # about 40 s
def test_gpt_oss_greedy_with_chunked_prefill_prefix_caching_and_preemption(gpt_oss_dir):
    """Prompts prefilled in 8-token chunks, the later prompts' shared 20-token prefix read from cached
    blocks, a pool small enough that sequences are preempted and recomputed, the windowed layers' blocks
    freed, on the reference backend: greedy tokens equal transformers' for each prompt alone."""
    from paged_jax import LLM, SamplingParams

    hf = load_hf(gpt_oss_dir)
    rng = np.random.default_rng(3)
    shared = rng.integers(3, hf.config.vocab_size, size=20).tolist()
    prompts = [shared + rng.integers(3, hf.config.vocab_size, size=n).tolist() for n in (3, 9, 14)]
    llm = LLM(str(gpt_oss_dir), block_size=4, max_model_len=128, enable_chunked_prefill=True,
              max_num_batched_tokens=8, enable_prefix_caching=True, num_kv_blocks=30, attention_backend="reference")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                               use_tqdm=False)]
    stats = llm.llm_engine.get_stats()
    assert sum(stats["num_preemptions"].values()) > 0
    for p, tokens in zip(prompts, got):
        assert tokens == _hf_greedy(hf, p, 24)


# --- attention sinks, backend by backend -----------------------------------------------------------


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_in_reference_blockwise_and_decode_equal_numpy(window):
    """The dense reference, the blockwise prefill (several K/V chunks) and the decode path, each with
    sinks, against the numpy oracle, over a scattered block table."""
    import jax.numpy as jnp

    from paged_jax.attention import (blockwise_prefill_attention, paged_attention_reference,
                                     paged_decode_attention)

    rng = np.random.default_rng(0)
    H, KVH, D, bs, L, Q = 4, 2, 8, 4, 23, 9
    table = rng.permutation(np.arange(1, 9))[: -(-L // bs)]
    k_cache = rng.standard_normal((9, bs, KVH, D)).astype(np.float32)
    v_cache = rng.standard_normal((9, bs, KVH, D)).astype(np.float32)
    q = rng.standard_normal((Q, H, D)).astype(np.float32)
    sinks = np.array([3.0, -1.0, 0.5, 8.0], np.float32)  # head 3's sink takes most of its weight
    want = numpy_attention(q[None], k_cache, v_cache, table[None], [L], [Q], 0.3, window, sinks=sinks)[0]
    args = (jnp.asarray(q)[None], k_cache, v_cache, jnp.asarray(table, jnp.int32)[None], jnp.array([L]), jnp.array([Q]))
    mask = None if window is None else (lambda qp, kp: kp > qp - window)
    dense = paged_attention_reference(*args, 0.3, sinks=sinks, mask_mod=mask)[0]
    blockwise = blockwise_prefill_attention(*args, 0.3, sliding_window=window, kv_chunk=8, q_chunk=4, sinks=sinks)[0]
    for got in (dense, blockwise):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    if window is None:
        decode = paged_decode_attention(jnp.asarray(q[-1:]), k_cache, v_cache, args[3], args[4], 0.3, sinks=sinks)
        np.testing.assert_allclose(np.asarray(decode)[0], want[-1], atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_in_the_native_kernel_equal_numpy(window):
    """The native ragged kernel with sinks, one sequence's 9 new queries (a chunk) and another's one (a
    decode) in one step, float32 and an int8 cache, against the numpy oracle."""
    import jax.numpy as jnp

    from paged_jax import native
    from paged_jax.attention import kv_quant

    if not native.available():
        pytest.skip("the native library is not available here")
    rng = np.random.default_rng(1)
    H, KVH, D, bs = 4, 2, 8, 4
    k_cache = rng.standard_normal((16, bs, KVH, D)).astype(np.float32)
    v_cache = rng.standard_normal((16, bs, KVH, D)).astype(np.float32)
    tables = np.stack([rng.permutation(np.arange(1, 8))[:6], rng.permutation(np.arange(8, 16))[:6]]).astype(np.int32)
    lens, qlens = np.array([23, 17], np.int32), np.array([9, 1], np.int32)
    q = rng.standard_normal((10, H, D)).astype(np.float32)
    sinks = np.array([3.0, -1.0, 0.5, 8.0], np.float32)
    want = np.concatenate([numpy_attention(q[a:a + n][None], k_cache, v_cache, t[None], [L], [n], 0.3, window,
                                           sinks=sinks)[0] for a, n, t, L in ((0, 9, tables[0], 23), (9, 1, tables[1], 17))])
    args = (tables, lens, np.array([0, 9], np.int32), qlens, 0.3, window, None)
    got = native.paged_attention(jnp.asarray(q), k_cache, v_cache, *args, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    k8, v8 = (kv_quant.quantize(jnp.asarray(c), jnp.int8) for c in (k_cache, v_cache))
    got8 = native.paged_attention(jnp.asarray(q), k8, v8, *args, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got8), want, atol=3e-2)


def test_backends_declare_or_refuse_sinks():
    """Every backend declares the sinks field or is refused, naming it: the Pallas kernels refuse them."""
    from paged_jax.attention import AttentionSpec, select_backend

    spec = AttentionSpec(0.25, sliding_window=8, sinks=True)
    assert select_backend("reference", [spec], "float32").name == "reference"
    assert "sinks" in select_backend("native", [spec], "float32", native_kernels=True).spec_fields
    for name in ("pallas", "pallas-interpret"):
        with pytest.raises(ValueError, match=rf"attention_backend='{name}' does not honour .*sinks=True"):
            select_backend(name, [spec], "float32")


def test_gpt_oss_config_and_refusals(gpt_oss_dir):
    """config.json as transformers writes it: layer kinds, YaRN, the clamped SwiGLU; an MXFP4 checkpoint
    is refused by name, before any weight is read."""
    import json

    from paged_jax.errors import ModelLoadError
    from paged_jax.models import model_config_from_hf

    cfg = json.loads((gpt_oss_dir / "config.json").read_text())
    c = model_config_from_hf(cfg)
    assert c.family == "gpt_oss" and c.rope_type == "yarn" and c.moe.swiglu_limit == 1.5
    assert c.moe.swiglu_alpha == pytest.approx(1.702) and c.moe.renormalize and c.attention_bias
    mxfp4 = dict(cfg, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["router"]})
    with pytest.raises(ModelLoadError, match="quant_method 'mxfp4' is not supported.*supported: float weights"):
        model_config_from_hf(mxfp4)
    with pytest.raises(ModelLoadError, match="layer_types must list"):
        model_config_from_hf(dict(cfg, layer_types=["sliding_attention"]))


@pytest.mark.slow  # about 70 s: a process with 2 CPU devices
def test_gpt_oss_expert_parallel_greedy_equals_transformers(gpt_oss_dir, tmp_path):
    """tensor_parallel_size=2: heads, their sinks and the 4 experts split over 2 devices (2 whole experts
    each), in a pool tight enough to swap, and restored from an orbax checkpoint straight into its shards;
    greedy tokens equal transformers'."""
    from paged_jax.parallel.checkpoint import convert
    from tests.test_tensor_parallel import run_worker

    hf = load_hf(gpt_oss_dir)
    prompts = _prompts(hf.config.vocab_size, sizes=(5, 21, 40, 13), seed=11)
    ckpt = convert(gpt_oss_dir, tmp_path / "ckpt")
    run = dict(tp=2, prompts=prompts, max_tokens=10, block_size=8)
    runs = run_worker(tmp_path, [dict(run, model=str(gpt_oss_dir), num_kv_blocks=14, preemption_mode="swap"),
                                 dict(run, model=str(ckpt), num_kv_blocks=64)], devices=2)
    want = [_hf_greedy(hf, p, 10) for p in prompts]
    for got in runs:
        assert got["shards"]["experts.gate"][0][0] == 2 and got["all_free"]
        assert got["tokens"] == want
    assert runs[0]["preemptions"]["swap"] > 0
