"""The simulator: the real engine, scheduler and block manager with a cost-model executor."""

from __future__ import annotations

import pytest

from experiments.cost_model import CostModel
from experiments.hardware import SETUPS, num_params
from experiments.simulate import (build_engine, memory_breakdown, run_trace, saturation_throughput,
                                  sustainable_rate)
from experiments.workloads import Request, make_trace
from paged_jax.sampling_params import SamplingParams

OPT13 = SETUPS["opt-13b"]


def test_engine_runs_requests_to_their_fixed_lengths_and_frees_every_block():
    engine, executor, clock = build_engine(OPT13, "vllm")
    lens = {"a": (30, 7), "b": (100, 40), "c": (5, 1)}
    for rid, (p, o) in lens.items():
        engine.add_request(rid, None, SamplingParams(max_tokens=o, ignore_eos=True), prompt_token_ids=[5] * p)
    done = {}
    t_prev = clock.now
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine.block_manager.check_invariants()
            if out.finished:
                done[out.request_id] = out
        assert clock.now > t_prev  # every iteration takes time
        t_prev = clock.now
    assert {r: len(o.outputs[0].token_ids) for r, o in done.items()} == {r: o for r, (_, o) in lens.items()}
    assert all(o.outputs[0].finish_reason == "length" for o in done.values())
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.gpu_allocator.num_total_blocks
    assert executor.stats.num_steps == 40  # the longest request: 1 prefill + 39 decodes


def test_parallel_samples_fork_and_share_the_prompt():
    engine, executor, _ = build_engine(OPT13, "vllm")
    engine.add_request("a", None, SamplingParams(n=4, best_of=4, max_tokens=20, ignore_eos=True),
                       prompt_token_ids=list(range(10, 74)))  # 64 tokens = 4 full blocks
    engine.step()
    bm = engine.block_manager
    seqs = engine.scheduler.running[0].seqs
    assert len(seqs) == 4
    tables = [bm.get_block_table(s) for s in seqs]
    assert all(t[:4] == tables[0][:4] for t in tables)  # the prompt's blocks are shared
    assert bm.get_usage().num_used_gpu_blocks == 4  # the prompt, held once
    engine.step()  # each sample's first token opens a block of its own
    assert bm.get_usage().num_used_gpu_blocks == 4 + 4
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        bm.check_invariants()
    assert len(outs[0].outputs) == 4 and all(len(c.token_ids) == 20 for c in outs[0].outputs)


def test_single_request_latency_equals_the_cost_model_sum():
    """An isolated request: its latency is its prefill step plus one decode step per further token."""
    cm = CostModel(OPT13, 16)
    p, o = 100, 12
    expect = cm.step_time([(p, 0)], 1) + sum(cm.step_time([(1, p + k - 1)], 1) for k in range(1, o))
    res = run_trace(OPT13, "vllm", [Request(3.0, p, o)])
    assert res.latencies[0] == pytest.approx(expect, rel=1e-9)
    assert res.normalized_latency == pytest.approx(expect / o)


def test_cost_model_rooflines():
    cm = CostModel(OPT13, 16)
    weights = num_params(OPT13.model) * 2 / (1.555e12 * 0.7)
    assert cm.weight_time == pytest.approx(weights)
    small = cm.step_time([(1, 100)], 1)
    assert small == pytest.approx(4e-3 + weights + 4 * 40 * 5120 * 100.5 / (312e12 * 0.5) * 0  # decode: no pairs
                                  + 101 * 819200 / (1.555e12 * 0.7 * 0.8) + 20e-6, rel=1e-6)
    # Decoding is weight-bound: a batch of 8 costs little more than a batch of 1 ...
    assert cm.step_time([(1, 100)] * 8, 8) < 1.3 * small
    # ... a long prefill is compute-bound: time grows with its tokens.
    assert cm.step_time([(2000, 0)], 1) > 2 * cm.step_time([(500, 0)], 1)
    # Tensor parallelism adds all-reduces; the contiguous kernel reads K/V faster than the paged one.
    assert CostModel(SETUPS["opt-66b"], 16).allreduce_fixed > 0 and cm.allreduce_fixed == 0
    assert CostModel(OPT13, 16, paged=False).step_time([(1, 1000)] * 32, 32) < cm.step_time([(1, 1000)] * 32, 32)
    # Per token, swapping small blocks costs more (more copy calls); recompute does not depend on it.
    per_token = [CostModel(OPT13, b).swap_time_per_block() / b for b in (1, 16, 256)]
    assert per_token[0] > per_token[1] > per_token[2]


# 15 s of simulated load: -m slow; test_paged_sustains_more_than_the_baselines runs the same systems by default
@pytest.mark.slow
def test_orca_and_paged_memory_breakdown():
    reqs = make_trace("sharegpt", 5.0, 250, seed=1)  # overloaded: memory is the limit
    shares = {}
    for system in ("vllm", "orca-oracle", "orca-max"):
        res = run_trace(OPT13, system, reqs, 4.0, sample_every=20, on_sample=memory_breakdown)
        assert sum(res.memory.values()) == pytest.approx(1.0)
        shares[system] = res.memory
    assert shares["vllm"]["token_states"] > 0.85 and shares["vllm"]["reservation"] == 0
    assert shares["orca-max"]["internal_frag"] > 0.4  # reserving 2048 tokens for ~500-token requests
    assert shares["orca-oracle"]["internal_frag"] == 0 and shares["orca-oracle"]["reservation"] > 0.1
    assert shares["vllm"]["token_states"] > shares["orca-oracle"]["token_states"] > shares["orca-max"]["token_states"]


def test_paged_sustains_more_than_the_baselines():
    reqs = make_trace("sharegpt", 1.0, 100, seed=2)
    caps = {s: saturation_throughput(OPT13, s, reqs)[0] for s in ("vllm", "orca-oracle", "orca-max", "ft")}
    assert caps["vllm"] > caps["orca-oracle"] > caps["orca-max"] > caps["ft"] > 0


def test_sustainable_rate_interpolates():
    assert sustainable_rate([1, 2, 3], [0.1, 0.2, 1.2], 0.7) == pytest.approx(2.5)
    assert sustainable_rate([1, 2], [0.1, 0.2], 0.7) == 2
    assert sustainable_rate([1, 2], [0.8, 0.9], 0.7) == 0.0


def test_unknown_system():
    with pytest.raises(ValueError, match="unknown system 'orca'"):
        build_engine(OPT13, "orca")


def test_simulated_beam_search_forks_and_frees_beams_with_sound_block_tables():
    """Beam requests run the engine's beam search over the simulated executor's candidates."""
    engine, executor, _ = build_engine(OPT13, "vllm")
    for i in range(3):
        engine.add_request(f"b{i}", None, SamplingParams(n=4, best_of=4, use_beam_search=True, temperature=0,
                                                         max_tokens=30, ignore_eos=True),
                           prompt_token_ids=list(range(10, 50 + 7 * i)))
    done, forked, shared = {}, 0, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.block_manager.check_invariants()
        for g in engine.scheduler.running:
            beams = g.get_unfinished_seqs()
            assert len(beams) in (1, 4)  # the beam width holds (1 before the first step's forks)
            forked = max(forked, max(s.seq_id for s in beams))
            tables = [engine.block_manager.get_block_table(s) for s in beams]
            shared |= len(beams) > 1 and len({b for t in tables for b in t}) < sum(map(len, tables))
    assert shared and forked > 3 * 4  # beams were re-forked after the first step
    assert all(len(o.outputs) == 4 and all(len(c.token_ids) == 30 for c in o.outputs) for o in done.values())
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.gpu_allocator.num_total_blocks


def test_beams_share_more_than_parallel_samples():
    from experiments.runner import run_point

    common = dict(workload="alpaca", system="vllm", rate=30.0, sample="sharing", num_requests=60)
    par = run_point(dict(common, n=4))
    beam = run_point(dict(common, beam_width=4))
    saved = lambda r: 1 - r["blocks_used"] / r["blocks_per_table_sum"]  # noqa: E731
    assert 0 < saved(par) < saved(beam) < 1


def test_static_batch_returns_together():
    reqs = [Request(0.0, 20, 5), Request(0.0, 20, 40), Request(0.0, 20, 12)]
    ft = run_trace(OPT13, "ft", reqs)
    orca = run_trace(OPT13, "orca-max", reqs)
    assert len(set(ft.latencies)) == 1  # one batch, one return time
    assert ft.latencies[0] == pytest.approx(orca.latencies.max())  # = when its longest request ends
    assert orca.latencies[0] < orca.latencies[2] < orca.latencies[1]
