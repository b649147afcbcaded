"""Mixture-of-experts: the shared layer against a numpy reference, and each MoE family's greedy tokens
against transformers through the engine (paged cache, small blocks, a batch of prompts prefilled and
decoded together)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.hf_models import load_hf


def numpy_moe(x, router, gate_up, down, top_k, scoring, renormalize, shared=None, shared_gate=None):
    """Token by token: scores, the top k experts, their weighted SwiGLU outputs (float64)."""
    x, router, gate_up, down = (np.asarray(a, np.float64) for a in (x, router, gate_up, down))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    out = np.zeros_like(x)
    I = down.shape[1]
    for t, row in enumerate(x):
        logits = row @ router
        scores = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() if scoring == "softmax" \
            else sigmoid(logits)
        chosen = np.argsort(-scores, kind="stable")[:top_k]
        w = scores[chosen] / scores[chosen].sum() if renormalize else scores[chosen]
        for e, we in zip(chosen, w):
            h = row @ gate_up[e]
            out[t] += we * (silu(h[:I]) * h[I:]) @ down[e]
        if shared is not None:
            g, u, d = (np.asarray(a, np.float64) for a in shared)
            out[t] += sigmoid(row @ np.asarray(shared_gate, np.float64))[0] * ((silu(row @ g) * (row @ u)) @ d)
    return out


def random_moe(rng, E, H, I, S):
    """Random weights of a mixture of ``E`` experts (``H`` wide, experts ``I``, a shared expert ``S``
    with its gate): the numpy arrays ``numpy_moe`` takes (router, gate_up, down, shared, shared_gate)
    and the layer's params, float32."""
    import jax.numpy as jnp

    from paged_jax.weights import DenseLinear, ExpertStack

    router = rng.standard_normal((H, E)).astype(np.float32)
    gate_up = (0.3 * rng.standard_normal((E, H, 2 * I))).astype(np.float32)
    down = (0.3 * rng.standard_normal((E, I, H))).astype(np.float32)
    shared = [(0.3 * rng.standard_normal(s)).astype(np.float32) for s in ((H, S), (H, S), (S, H))]
    shared_gate = rng.standard_normal((H, 1)).astype(np.float32)
    stack = lambda w: ExpertStack(DenseLinear(jnp.asarray(w)))  # noqa: E731
    params = {"router": DenseLinear(jnp.asarray(router)), "gate": stack(gate_up[..., :I]),
              "up": stack(gate_up[..., I:]), "down": stack(down),
              "shared": {n: DenseLinear(jnp.asarray(w)) for n, w in zip(("gate", "up", "down"), shared)},
              "shared_gate": DenseLinear(jnp.asarray(shared_gate))}
    return router, gate_up, down, shared, shared_gate, params


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("sigmoid", False),
                                                 pytest.param("softmax", False, marks=pytest.mark.slow)])
def test_moe_layer_matches_numpy_reference(scoring, renormalize):
    import jax
    import jax.numpy as jnp

    from paged_jax.models import moe
    from paged_jax.weights import DenseLinear

    E, k, H, I, S = 8, 2, 16, 12, 10
    rng = np.random.default_rng(0)
    router, gate_up, down, shared, shared_gate, params = random_moe(rng, E, H, I, S)
    cfg = moe.MoEConfig(E, k, I, renormalize, (0,), scoring=scoring, shared_intermediate_size=S,
                        shared_expert_gate=True)
    run = jax.jit(lambda p, x, real: moe.moe_mlp(p, cfg, x, real))  # the engine's path: real tokens marked
    biased = router.copy()
    biased[:, 4] += 50.0  # every token's first choice is expert 4: one segment as long as the batch
    for T, r in ((2, router), (24, router), (24, biased)):  # 2 tokens: the few-token path
        x = rng.standard_normal((T, H)).astype(np.float32)
        chosen = np.argsort(-(x @ r), axis=1)[:, :k]
        if T == 24:  # the case is what it claims: the step's tokens go to several experts
            assert len(np.unique(chosen)) >= 3
        got = np.asarray(run(dict(params, router=DenseLinear(jnp.asarray(r))), jnp.asarray(x), jnp.ones(T, bool)))
        want = numpy_moe(x, r, gate_up, down, k, scoring, renormalize, shared, shared_gate)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{T} tokens")
    # a batch padded with copies of one token: the padding routes nowhere (its output: the shared
    # expert's alone), the real tokens are as before
    x = np.concatenate([rng.standard_normal((17, H)), np.repeat(rng.standard_normal((1, H)), 7, axis=0)]).astype(np.float32)
    real = np.arange(24) < 17
    got = np.asarray(run(params, jnp.asarray(x), jnp.asarray(real)))
    np.testing.assert_allclose(got[:17], numpy_moe(x[:17], router, gate_up, down, k, scoring, renormalize, shared,
                                                   shared_gate), rtol=2e-5, atol=2e-5)
    no_experts = numpy_moe(x[17:], router, gate_up, 0 * down, k, scoring, renormalize, shared, shared_gate)
    np.testing.assert_allclose(got[17:], no_experts, rtol=2e-5, atol=2e-5)


def test_window_ladder_holds_every_segment():
    from paged_jax.models.moe_experts import window_sizes

    for T in (1, 2, 7, 8, 9, 33, 100, 2048):
        sizes = window_sizes(T)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == T
        assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))  # a segment's window is under twice its size


def routed_experts(hf, prompt) -> set:
    """The layer-0 experts transformers' router picks for the prompt's tokens."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_router_logits=True)
    logits = out.router_logits[0]
    return set(torch.topk(logits, hf.config.num_experts_per_tok, dim=-1).indices.flatten().tolist())


@pytest.mark.slow  # about 15 s each; the default set checks each family's logits (tests/test_models.py)
@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_family_greedy_equals_transformers(hf_model_dir, variant):
    """Four prompts prefilled in one step and decoded together over 4-token blocks, then one alone: each
    one's greedy tokens equal transformers' ``generate`` for it alone. The step's tokens go to several
    experts."""
    from paged_jax import LLM, SamplingParams, native

    path = hf_model_dir(variant)
    hf = load_hf(path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, hf.config.vocab_size, size=n).tolist() for n in (3, 9, 17, 30)]
    assert len(routed_experts(hf, sum(prompts, []))) >= 3
    native.build._traced.discard("linear grouped float32")  # traced again below, by this engine's steps
    llm = LLM(str(path), block_size=4, max_model_len=96)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    # and the last prompt alone: its decoding steps have one token (the few-token path)
    alone = llm.generate(prompt_token_ids=prompts[-1:],
                         sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    if native.available() and native.packs_weights():  # the engine ran the float32 experts natively
        assert "linear grouped float32" in native.status()["traced"]
    for p, out in zip(prompts + prompts[-1:], outs + alone):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
        assert list(out.outputs[0].token_ids) == want[0, len(p):].tolist()


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_sparse_layers_are_the_ones_transformers_builds(arch):
    import transformers

    from paged_jax.models import model_config_from_hf

    base = dict(architectures=[arch], vocab_size=32, hidden_size=16, intermediate_size=24,
                moe_intermediate_size=8, shared_expert_intermediate_size=8, num_hidden_layers=5,
                num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)
    for step, dense in ((1, []), (2, []), (2, [3]), (1, [0, 4])):
        cfg = dict(base, decoder_sparse_step=step, mlp_only_layers=dense)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            arch.replace("ForCausalLM", "").replace("Moe", "_moe").lower(), **cfg))
        want = tuple(i for i, lay in enumerate(hf.model.layers) if type(lay.mlp).__name__.endswith("SparseMoeBlock"))
        assert model_config_from_hf(cfg).moe.sparse_layers == want, (step, dense)


def test_moe_configs_refuse_what_they_cannot_run():
    from paged_jax.errors import ModelLoadError
    from paged_jax.models import model_config_from_hf

    base = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=128,
                moe_intermediate_size=16, shared_expert_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    c = model_config_from_hf(base)
    assert c.moe.shared_expert_gate and not c.moe.renormalize and c.attention_bias  # qkv_bias defaults to true
    q3 = model_config_from_hf(dict(base, architectures=["Qwen3MoeForCausalLM"], num_experts=None,
                                   num_local_experts=4, norm_topk_prob=True))
    assert q3.moe.renormalize and not q3.moe.shared_intermediate_size  # transformers 5 writes num_local_experts
    with pytest.raises(ModelLoadError, match="num_experts_per_tok must be in 1..4.*got 5"):
        model_config_from_hf(dict(base, num_experts_per_tok=5))
    mixtral = dict(base, architectures=["MixtralForCausalLM"], num_local_experts=8)
    assert model_config_from_hf(mixtral).moe.renormalize
    with pytest.raises(ModelLoadError, match="num_local_experts"):
        model_config_from_hf({k: v for k, v in mixtral.items() if k != "num_local_experts"})


# One pool keeping every layer's blocks, and (Gemma 3) its six layer groups: pages of one layer, the
# windowed groups taking a prompt's blocks chunk by chunk. Each pool admits two of the prompts and preempts.
ONE_POOL = dict(num_kv_blocks=22, free_blocks_outside_window=False)
LAYER_GROUPS = dict(num_kv_blocks=45)


@pytest.mark.slow  # about 20 s each
@pytest.mark.parametrize("variant,pool", [("mixtral", ONE_POOL), ("qwen2_moe", ONE_POOL), ("qwen3_moe", ONE_POOL),
                                          ("gemma3", ONE_POOL), ("gemma3", LAYER_GROUPS)],
                         ids=["mixtral", "qwen2_moe", "qwen3_moe", "gemma3", "gemma3-layer-groups"])
def test_new_families_greedy_with_chunked_prefill_prefix_caching_and_preemption(hf_model_dir, variant, pool):
    """The engine's other paths: prompts prefilled in 8-token chunks, the later prompts' shared prefix read
    from cached blocks, and a pool small enough that sequences are preempted and recomputed; greedy tokens
    equal transformers' for each prompt alone."""
    from paged_jax import LLM, SamplingParams

    path = hf_model_dir(variant)
    hf = load_hf(path)
    rng = np.random.default_rng(3)
    shared = rng.integers(3, hf.config.vocab_size, size=20).tolist()
    prompts = [shared + rng.integers(3, hf.config.vocab_size, size=n).tolist() for n in (3, 9, 14)]
    llm = LLM(str(path), block_size=4, max_model_len=128, enable_chunked_prefill=True, max_num_batched_tokens=8,
              enable_prefix_caching=True, **pool)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                               use_tqdm=False)]
    assert sum(llm.llm_engine.get_stats()["num_preemptions"].values()) > 0
    for p, tokens in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0)
        assert tokens == want[0, len(p):].tolist()
