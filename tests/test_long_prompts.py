"""Prompts of 3,000+ tokens end to end against transformers (float32 greedy, the oracle): chunked
prefill beside running decodes, under preemption (swap and recompute) and with prefix caching, for
LLaMA with llama3 RoPE scaling (an original context of 1,024, so every long prompt and its generated
tokens sit far beyond it), OPT and GPT-2 (learned positions up to 4,096).

The main assertion is always equal token ids. Each chosen token's logprob is also compared with
transformers' log-softmax at that step, so a numerical drift shows before it flips a token. The tiny
random models have near-ties (here transformers' top two tokens are 3e-5 apart at one step): where
paged-jax picks a token within the logprob tolerance of transformers' best, the comparison stops there
instead of failing (see ``assert_matches_hf``); with today's data every token is equal."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import numpy as np
import pytest
import torch

from paged_jax import LLM, SamplingParams
from tests.hf_models import load_hf

LLAMA, OPT, GPT2 = "llama_long_llama3", "opt_long", "gpt2_long"
VOCAB = 512  # the tiny tokenizers' vocabulary (paged_jax.models.tiny.train_tokenizer)
MAX_TOKENS = 16
BUDGET = 256  # the default chunked budget: a 3,000-token prompt takes a dozen chunks
LOGPROB_ATOL = 2e-4  # seen: under 1e-5 between the two float32 implementations, on every token here
TIE = LOGPROB_ATOL  # a lead smaller than the logprobs may differ by: either token is a correct greedy choice


def random_prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=length).tolist()


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    return load_hf(path)


@functools.lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: tuple[int, ...], max_tokens: int = MAX_TOKENS):
    """transformers' greedy tokens and its log-softmax over the vocabulary at each step ([steps, vocab])."""
    model = hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # min_new_tokens: generate all max_tokens, as paged-jax does with ignore_eos
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=0)
        logprobs = torch.log_softmax(model(out).logits[0, len(prompt) - 1:-1].float(), -1).numpy()
    tokens = out[0, len(prompt):].tolist()
    # min_new_tokens bans EOS, which ignore_eos does not: the comparison is fair only while EOS was
    # never the model's own greedy choice (each chosen token is the best of its unbanned log-softmax).
    lead = logprobs.max(-1) - logprobs[np.arange(max_tokens), tokens]
    assert (lead < TIE).all(), f"transformers banned its greedy choice (EOS) at steps {np.flatnonzero(lead >= TIE)}"
    return tokens, logprobs


def assert_matches_hf(path, prompts, outputs, max_tokens=MAX_TOKENS):
    """paged-jax's greedy tokens equal transformers', and the logprob of each is within LOGPROB_ATOL of
    transformers' log-softmax at its step. ``max_tokens``: one for all prompts, or one per prompt.

    Only a near-tie may end the comparison early: where transformers' best token leads paged-jax's
    choice by less than TIE, float32 rounding decides, and the two continuations then differ, so the
    tokens after it are not compared (a warning says so)."""
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    for i, (prompt, out, n) in enumerate(zip(prompts, outputs, max_tokens)):
        want, hf_logprobs = hf_greedy(str(path), tuple(prompt), n)
        got = list(out.outputs[0].token_ids)
        assert len(got) == len(want) == n, (i, got, want)
        compared = n
        k = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if k is not None:
            lead = hf_logprobs[k, want[k]] - hf_logprobs[k, got[k]]
            if lead >= TIE:
                pytest.fail(f"prompt {i} ({len(prompt)} tokens): tokens differ from transformers' at step {k}, "
                            f"where transformers' choice leads paged-jax's by {lead:.2e} in logprob:\n"
                            f" got  {got}\n want {want}")
            warnings.warn(f"prompt {i}: a near-tie at step {k} (lead {lead:.1e}): tokens compared up to it")
            compared = k + 1
        got_lp = [entry[tok] for entry, tok in zip(out.outputs[0].logprobs[:compared], got)]
        want_lp = hf_logprobs[np.arange(compared), got[:compared]]
        np.testing.assert_allclose(got_lp, want_lp, rtol=0, atol=LOGPROB_ATOL,
                                   err_msg=f"prompt {i} ({len(prompt)} tokens): logprobs of the chosen tokens")


def greedy_params(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def generate(llm, prompts, max_tokens=MAX_TOKENS):
    """``max_tokens``: one for all prompts, or one per prompt."""
    params = (greedy_params(max_tokens) if isinstance(max_tokens, int)
              else [greedy_params(n) for n in max_tokens])
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


@contextlib.contextmanager
def recorded_steps(llm):
    """Yields a list that receives, for each step the engine runs, its scheduled rows as
    (prompt length, start position, number of tokens) and the prompt lengths of the requests it preempted."""
    runner = llm.llm_engine.runner
    execute = runner.execute
    steps = []

    def recording(out, *args):
        if out.scheduled or out.preempted:
            steps.append(dict(rows=[(r.seq.get_prompt_len(), r.start_pos, r.num_tokens) for r in out.scheduled],
                              preempted=[g.seqs[0].get_prompt_len() for g, _ in out.preempted]))
        return execute(out, *args)

    runner.execute = recording
    try:
        yield steps
    finally:
        runner.execute = execute


def first_starts(steps) -> dict[int, int]:
    """Per prompt length, the position its first recorded chunk started at (a prefix hit starts past 0)."""
    starts: dict[int, int] = {}
    for step in steps:
        for prompt_len, start, _ in step["rows"]:
            starts.setdefault(prompt_len, start)
    return starts


def assert_all_free(llm):
    stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_free_cpu_blocks"] == stats["num_total_cpu_blocks"], stats
    llm.llm_engine.block_manager.check_invariants()


# ---- chunked prefill beside running decodes -----------------------------------------------------

SHORT_LENGTHS = (24, 40, 56, 72)
LONG_LENGTH = 3_100


# "auto" is the native decode kernel where it builds (as here), else "reference"; "reference" runs
# decodes through jnp too (both prefill blockwise in jnp)
@pytest.mark.parametrize("variant, backend", [(LLAMA, "auto"),
                                              pytest.param(LLAMA, "reference", marks=pytest.mark.slow),
                                              pytest.param(OPT, "auto", marks=pytest.mark.slow),
                                              pytest.param(GPT2, "auto", marks=pytest.mark.slow)])
def test_long_prompt_in_chunks_beside_decodes_matches_hf(hf_model_dir, variant, backend):
    path = hf_model_dir(variant)
    # The short requests come first: they are prefilled in the first step and then decode in every
    # step while the long prompt runs chunk by chunk, so the steps mix decodes and chunks.
    prompts = [random_prompt(n, seed=n) for n in SHORT_LENGTHS] + [random_prompt(LONG_LENGTH, seed=1)]
    llm = LLM(model=str(path), max_num_batched_tokens=BUDGET, max_num_seqs=8, num_kv_blocks=512,
              attention_backend=backend)
    assert llm.llm_engine.scheduler_config.enable_chunked_prefill  # the default
    with recorded_steps(llm) as steps:
        outputs = generate(llm, prompts)
    assert_matches_hf(path, prompts, outputs)

    chunk_steps = [s["rows"] for s in steps if any(p == LONG_LENGTH and n > 1 for p, _, n in s["rows"])]
    assert len(chunk_steps) >= math.ceil(LONG_LENGTH / BUDGET)
    assert all(sum(n for _, _, n in rows) <= BUDGET for rows in chunk_steps)
    # every chunk after the first runs beside the short requests' decodes, in one step
    mixed = [rows for rows in chunk_steps[1:]
             if sum(p != LONG_LENGTH and n == 1 for p, _, n in rows) == len(SHORT_LENGTHS)]
    assert len(mixed) == len(chunk_steps) - 1, chunk_steps
    assert_all_free(llm)


# ---- preemption ---------------------------------------------------------------------------------

# Three short requests that generate 64 tokens each and two long prompts that generate 16. With blocks
# of 4 tokens the prompts hold 8 + 13 + 18 + 750 + 825 = 1,614 blocks (plus the null block), and the
# short requests' decodes need 16 blocks more each. The long prompts run one after the other (each
# fills the token budget), and the watermark is 0, so the second one (3,300 tokens) is admitted with
# only a few blocks to spare; when the short requests' decodes run out of blocks it, the newest, is
# preempted: in a pool of 1,632 blocks in the middle of its prefill, in one of 1,640 right after its
# first generated token (positions past 3,300, more than three times llama3's original context).
PREEMPT_LENGTHS = (30, 50, 70, 3_000, 3_300)
PREEMPT_MAX_TOKENS = (64, 64, 64, 16, 16)
PREEMPT_POOLS = {"mid-prefill": 1_632, "decoding": 1_640}


def preempted_phases(steps, prompt_len):
    """For each preemption of the request with ``prompt_len`` tokens: "mid-prefill" or "decoding",
    from the last row it ran before."""
    phases, last = [], None
    for step in steps:
        if prompt_len in step["preempted"]:
            phases.append("decoding" if last == 1 else "mid-prefill")
        last = next((n for p, _, n in step["rows"] if p == prompt_len), last)
    return phases


# one case in the default run, the rest with -m slow
PREEMPT_CASES = [pytest.param(variant, mode, phase, id=f"{variant}-{mode}-{phase}",
                              marks=() if (variant, mode, phase) == (LLAMA, "recompute", "decoding")
                              else pytest.mark.slow)
                 for variant in (LLAMA, OPT, GPT2) for mode in ("recompute", "swap") for phase in PREEMPT_POOLS]


@pytest.mark.parametrize("variant, mode, phase", PREEMPT_CASES)
def test_long_prompt_preempted_matches_hf(hf_model_dir, variant, mode, phase):
    path = hf_model_dir(variant)
    prompts = [random_prompt(n, seed=n) for n in PREEMPT_LENGTHS]
    llm = LLM(model=str(path), max_num_batched_tokens=BUDGET, max_num_seqs=8, block_size=4,
              num_kv_blocks=PREEMPT_POOLS[phase], watermark=0.0, preemption_mode=mode)
    with recorded_steps(llm) as steps:
        outputs = generate(llm, prompts, PREEMPT_MAX_TOKENS)
    assert_matches_hf(path, prompts, outputs, PREEMPT_MAX_TOKENS)

    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"][mode] > 0, stats
    # the pool sizes above are chosen for this: if the scheduler changes, tune them again
    assert phase in preempted_phases(steps, PREEMPT_LENGTHS[-1]), steps
    assert_all_free(llm)


# ---- prefix caching -----------------------------------------------------------------------------

PREFIX_LENGTH = 2_200
PREFIX_BLOCK = 16


@pytest.mark.parametrize("variant", [LLAMA, pytest.param(OPT, marks=pytest.mark.slow),
                                     pytest.param(GPT2, marks=pytest.mark.slow)])
def test_long_shared_prefix_cached_matches_hf(hf_model_dir, variant):
    path = hf_model_dir(variant)
    prefix = random_prompt(PREFIX_LENGTH, seed=7)
    first = prefix + random_prompt(900, seed=8)
    second = prefix + random_prompt(1_000, seed=9)
    llm = LLM(model=str(path), max_num_batched_tokens=BUDGET, max_num_seqs=8, block_size=PREFIX_BLOCK,
              num_kv_blocks=512, enable_prefix_caching=True)
    outputs = generate(llm, [first])
    # The second request runs after the first has finished, so it finds the prefix's full blocks in
    # the cache and computes only the rest, in chunks; the first prompt again finds all its full blocks.
    with recorded_steps(llm) as steps:
        outputs += generate(llm, [second, first])
    assert_matches_hf(path, [first, second, first], outputs)

    starts = first_starts(steps)
    assert starts[len(second)] == PREFIX_LENGTH // PREFIX_BLOCK * PREFIX_BLOCK, starts
    assert starts[len(first)] == (len(first) - 1) // PREFIX_BLOCK * PREFIX_BLOCK, starts
    assert_all_free(llm)
