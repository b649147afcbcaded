"""experiments/profile_gpu_step.py's pieces on the CPU: its copy counter on a real engine (greedy batches
read the step's argmax, sampled ones call the sampler once a step and send its tensors, every sample's
id and logprob come back) and its per-kind sums of trace events. The whole script runs in gpu_check.sh's
CPU dry run (tests/test_gpu_check.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import profile_gpu_step  # noqa: E402

from paged_jax import LLM, SamplingParams  # noqa: E402
from paged_jax.sampler import SamplingTensors  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


def test_copy_counter_counts_sampler_calls_and_the_arrays_each_way(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=32, block_size=16, max_model_len=64)
    engine = llm.llm_engine
    engine.runner.run_ahead = False  # one step call per engine step, so that both runs send the same batches
    counter = profile_gpu_step.CopyCounter(engine.runner)
    seen = {}
    for temperature in (0.0, 1.0):
        before, steps = counter.snapshot(), engine.num_steps
        params = SamplingParams(temperature=temperature, max_tokens=5, ignore_eos=True, seed=1)
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5, 5]
        h2d, h2d_arrays, d2h, d2h_arrays, sampler_calls = counter.snapshot() - before
        seen[temperature] = h2d_arrays, engine.num_steps - steps
        steps = engine.num_steps - steps
        # Greedy: the tiny vocabulary keeps every batch under the step's argmax bound.
        assert sampler_calls == (0 if temperature == 0 else steps)
        assert d2h >= 8 * 15  # an int32 id and a float32 logprob a sample, at least
        assert d2h_arrays == 2 * steps  # every step samples: its ids and logprobs, read once each
        assert h2d > 0
    # The same steps' batches both times; sampled, each step also sends the sampler's tensors ...
    (greedy, steps), (sampled, steps_sampled) = seen[0.0], seen[1.0]
    assert steps == steps_sampled
    tensors = SamplingTensors.from_params([(params, 1, PROMPTS[0], [])], 1000, pad_to=4, eos_token_id=2,
                                          engine_seed=0, step=0)
    per_call = sum(isinstance(x, np.ndarray) for x in jax.tree.leaves(tensors))
    # ... and the prompts' step its row selection's indices (its logits have a row per token).
    assert sampled - greedy == steps * per_call + 1


def test_by_kind_sums_instances_per_step_and_side():
    events = [(True, "fusion.12", 30.0), (True, "fusion.3", 10.0), (True, "gemm_1", 8.0),
              (False, "PjitFunction(jit(step))", 50.0), (False, "fusion.12", 4.0)]
    got = profile_gpu_step.by_kind(events, steps=2, top=5)
    assert got[True] == [("fusion", 20.0, 2), ("gemm", 4.0, 1)]
    assert got[False] == [("PjitFunction(jit(step))", 25.0, 1), ("fusion", 2.0, 1)]
    assert profile_gpu_step.by_kind(events, steps=2, top=1)[True] == [("fusion", 20.0, 2)]
