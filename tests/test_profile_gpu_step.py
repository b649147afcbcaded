"""experiments/profile_gpu_step.py's pieces on the CPU: its copy counter on a real engine (greedy batches
read the step's argmax, sampled ones call the sampler once a step, and every sample's id and logprob
come back) and its per-kind sums of trace events. The whole script runs in gpu_check.sh's CPU dry run
(tests/test_gpu_check.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import profile_gpu_step  # noqa: E402

from paged_jax import LLM, SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_copy_counter_counts_sampler_calls_and_the_samples_read(tiny_llama_dir, temperature):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=32, block_size=16, max_model_len=64)
    counter = profile_gpu_step.CopyCounter(llm.llm_engine.runner)
    steps = llm.llm_engine.num_steps
    params = SamplingParams(temperature=temperature, max_tokens=5, ignore_eos=True, seed=1)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    steps = llm.llm_engine.num_steps - steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == 15
    # Greedy: the tiny vocabulary keeps every batch under the step's argmax bound.
    assert counter.sampler_calls == (0 if temperature == 0 else steps)
    assert counter.d2h >= 8 * tokens  # an int32 id and a float32 logprob a sample, at least
    assert counter.d2h_arrays == 2 * steps  # every step samples: its ids and logprobs, read once each
    assert counter.h2d > 0


def test_by_kind_sums_instances_per_step_and_side():
    events = [(True, "fusion.12", 30.0), (True, "fusion.3", 10.0), (True, "gemm_1", 8.0),
              (False, "PjitFunction(jit(step))", 50.0), (False, "fusion.12", 4.0)]
    got = profile_gpu_step.by_kind(events, steps=2, top=5)
    assert got[True] == [("fusion", 20.0, 2), ("gemm", 4.0, 1)]
    assert got[False] == [("PjitFunction(jit(step))", 25.0, 1), ("fusion", 2.0, 1)]
    assert profile_gpu_step.by_kind(events, steps=2, top=1)[True] == [("fusion", 20.0, 2)]
