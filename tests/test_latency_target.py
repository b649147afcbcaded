"""A latency target (``target_itl_ms``): prefill chunks sized by a step-cost model fitted online.

The chunk sizing is checked against the arithmetic with fixed coefficients (no timing); the fit
against synthetic timings with known coefficients, noise and outliers; the loop (measure, fit,
size) in the simulator on its simulated clock; the real engine's greedy tokens against the same
engine without a target.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.engine_args import EngineArgs
from paged_jax.memory.block_manager import BlockManager
from paged_jax.scheduler import Scheduler, SchedulerConfig
from paged_jax.sequence import SequenceStatus
from paged_jax.step_budget import UNCALIBRATED_BUDGET, StepBudget
from paged_jax.step_cost import StepCostModel, StepLoad, calibrate, robust_nnls, with_knee
from tests.test_scheduler import advance, group

BS = 16  # block size of the scheduler tests


def fixed_model(step=2e-3, row=0.0, token=1e-4, decode_context=0.0, prefill_pair=0.0, prefill_read=0.0,
                query_tile=None) -> StepCostModel:
    model = StepCostModel(query_tile=query_tile)
    # Knee 1: one slope for every token.
    model.coefficients = np.array([step, row, token, token, decode_context, prefill_pair, prefill_read])
    return model


def seconds(coef, rows: list[tuple[int, int]]) -> float:
    """The step time the coefficients give, written out term by term (the tests' own arithmetic)."""
    step, row, token, _, dctx, pair, read = coef
    t = step + row * len(rows) + token * sum(q for q, _ in rows)
    t += dctx * sum(c for q, c in rows if q == 1)
    t += pair * sum(q * (c + (q + 1) / 2) for q, c in rows if q > 1)
    t += read * sum((c + q) * math.ceil(q / TILE) for q, c in rows if q > 1)  # keys read once per query tile
    return t


def expected_chunk(coef, target, decodes: list[tuple[int, int]], start: int, need: int, cap: int) -> int:
    """The largest chunk within the target, cut to a block boundary unless it is the whole rest; at
    least the tokens up to the next block boundary (progress)."""
    limit = min(need, cap)
    n = max([q for q in range(limit + 1) if seconds(coef, decodes + ([(q, start)] if q else [])) <= target])
    if n < need:
        n = max(0, (start + n) // BS * BS - start)
    return n or min(limit, BS - start % BS)


def make(num_blocks, cpu_blocks=0, step_cost=None, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(BS, num_blocks, cpu_blocks, watermark=0.0), step_cost)


def scheduler_with_streams(model, target_ms, streams=4, budget=2048, long_len=1000):
    s = make(num_blocks=400, max_model_len=2048, max_num_batched_tokens=budget,
             enable_chunked_prefill=True, target_itl_ms=target_ms, step_cost=model)
    for i in range(streams):
        s.add_seq_group(group(f"s{i}", 5, max_tokens=500))
    for _ in range(100):  # the streams' prompts
        if all(g.seqs[0].get_output_len() for g in s.running + list(s.waiting)):
            break
        advance(s, s.schedule())
    else:
        raise AssertionError("the streams' prompts did not finish")
    s.add_seq_group(group("long", long_len, max_tokens=1))
    return s


def run_long_prefill(s):
    """Steps until the long prompt has its first token: [(decode rows, long chunk and its start)]."""
    steps = []
    for _ in range(2000):
        out = s.schedule()
        decodes = [(r.num_tokens, r.start_pos) for r in out.scheduled if r.group.request_id != "long"]
        long = [(r.num_tokens, r.start_pos) for r in out.scheduled if r.group.request_id == "long"]
        assert all(q == 1 for q, _ in decodes)  # the target never holds back a decode
        steps.append((decodes, long[0] if long else None))
        advance(s, out)
        if long and long[0][0] + long[0][1] == 1000:
            return steps
    raise AssertionError("the long prompt did not finish its prefill in 2,000 steps")


TILE = 64  # the fixed models' query tile


@pytest.mark.parametrize("coef", [dict(), dict(prefill_pair=1e-7),
                                  dict(row=3e-4, decode_context=1e-6, prefill_pair=4e-8, prefill_read=2e-6)])
def test_chunks_are_the_largest_the_target_allows(coef):
    model = fixed_model(**coef, query_tile=TILE)
    target_ms = 10.05
    s = scheduler_with_streams(model, target_ms)
    steps = run_long_prefill(s)
    for decodes, (q, start) in steps:
        want = expected_chunk(model.coefficients, target_ms / 1e3, decodes, start, 1000 - start, 2048 - len(decodes))
        assert q == want, (decodes, start)
    chunks = [q for _, (q, _) in steps]
    assert chunks[0] == 64 if not coef else True  # 2 ms + (4 + n) * 0.1 ms <= 10.05 ms: n = 76, cut to 64
    assert sum(chunks) == 1000 and len(steps) > 5


def test_a_target_below_any_chunk_still_finishes_the_prompt_one_block_per_step():
    s = scheduler_with_streams(fixed_model(), target_ms=1.0)  # the step alone is predicted at 2 ms
    steps = run_long_prefill(s)
    assert [q for _, (q, _) in steps] == [16] * 62 + [8]
    assert all(len(d) == 4 for d, _ in steps)  # every stream got its token each step


def test_without_a_target_or_before_calibration_chunks_are_the_token_budget():
    steps = run_long_prefill(scheduler_with_streams(None, None, budget=256))
    assert [q for _, (q, _) in steps][:3] == [252, 252, 252]  # today's: the budget minus the decodes
    uncalibrated = StepCostModel()
    steps = run_long_prefill(scheduler_with_streams(uncalibrated, 5.0))
    assert [q for _, (q, _) in steps][:3] == [UNCALIBRATED_BUDGET - 4] * 3


def test_several_prompts_fill_what_the_target_leaves_and_the_first_always_progresses():
    s = make(num_blocks=400, max_model_len=2048, max_num_batched_tokens=2048,
             enable_chunked_prefill=True, target_itl_ms=20.05, step_cost=fixed_model())
    for i, n in enumerate([40, 30, 500]):
        s.add_seq_group(group(f"p{i}", n, max_tokens=3))
    out = s.schedule()
    # 2 ms + 0.1 ms per token within 20.05 ms: 180 tokens; 40 + 30 whole, then 110 cut to 96 (a block boundary).
    assert [(r.group.request_id, r.num_tokens) for r in out.scheduled] == [("p0", 40), ("p1", 30), ("p2", 96)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 300), st.integers(1, 12)), min_size=1, max_size=12),
       st.floats(0.5, 40.0), st.sampled_from([0.0, 5e-8]), st.sampled_from(["recompute", "swap"]))
def test_random_arrivals_finish_lose_no_block_and_keep_the_target(arrivals, target_ms, pair, mode):
    """Requests arrive at random steps into a small pool (preemptions); every one finishes, blocks all
    come back, and a step's prediction exceeds the target only when a prompt's progress needs it."""
    model = fixed_model(prefill_pair=pair)
    s = make(num_blocks=48, cpu_blocks=64, max_model_len=512, max_num_batched_tokens=512,
             enable_chunked_prefill=True, target_itl_ms=target_ms, step_cost=model, preemption_mode=mode)
    pending = sorted(((at, n, m, f"r{i}") for i, (at, n, m) in enumerate(arrivals)), reverse=True)
    groups, step = [], 0
    while pending or s.has_unfinished_seqs():
        while pending and pending[-1][0] <= step:
            _, n, m, rid = pending.pop()
            groups.append(group(rid, n, max_tokens=m))
            s.add_seq_group(groups[-1])
        out = s.schedule()
        load = StepLoad.of((r.num_tokens, r.start_pos) for r in out.scheduled)
        prefill = [r for r in out.scheduled if r.num_tokens > 1 or r.seq.num_computed_tokens < r.seq.get_len() - 1]
        if model.predict(load) > target_ms / 1e3 + 1e-12 and prefill:
            # Over the target: only the progress rule's one chunk (to a block boundary), or decodes alone.
            assert len(prefill) == 1 and prefill[0].num_tokens <= BS
        advance(s, out)
        step += 1
        assert step < 5000, "starved"
    assert all(g.is_finished() for g in groups)
    assert not any(seq.status is SequenceStatus.FINISHED_IGNORED for g in groups for seq in g.seqs)
    bm = s.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.gpu_allocator.num_total_blocks
    assert bm.get_num_free_cpu_blocks() == bm.cpu_allocator.num_total_blocks


# ---- the fit -----------------------------------------------------------------------------------
# Step, row, token up to the knee (64 tokens), past it, decode context, prefill pair, prefill read.
TRUE = np.array([3e-3, 4e-5, 2.5e-4, 1.5e-4, 2e-8, 3e-9, 3e-7])
TRUE_KNEE = 64


def true_seconds(model, load):
    return float(with_knee(model.features(load), TRUE_KNEE) @ TRUE)


def synthetic_loads(rng, n):
    loads = []
    for _ in range(n):
        rows = [(1, int(rng.integers(1, 2000))) for _ in range(int(rng.integers(1, 64)))]
        if rng.random() < 0.5:
            rows.append((int(rng.integers(16, 1024)), int(rng.integers(0, 8000))))
        loads.append(StepLoad.of(rows))
    return loads


def test_the_fit_recovers_known_coefficients_from_noisy_timings_despite_outliers():
    rng = np.random.default_rng(0)
    model = StepCostModel(window=256, refit_every=1000)
    loads = synthetic_loads(rng, 400)
    truth = np.array([true_seconds(model, x) for x in loads])
    measured = truth * rng.lognormal(0, 0.05, len(truth))  # 5 % noise
    bad = rng.choice(len(loads), 12, replace=False)  # 3 % wild: 30x slower or 30x faster
    measured[bad[:6]] *= 30
    measured[bad[6:]] /= 30
    for x, y in zip(loads, measured):
        model.observe(x, float(y))
    model.fit()
    assert model.calibrated and TRUE_KNEE / 1.5 <= model.knee <= TRUE_KNEE * 1.5  # a neighbour of 64 fits as well
    rel = model.coefficients / TRUE - 1
    # The large terms within 5 %; the small ones (a few % of a step's time: weakly determined by
    # 5 % noise) within a factor of two.
    assert np.all(np.abs(rel[[0, 3]]) < 0.05) and np.all(np.abs(rel) < 1.0), rel
    fresh = synthetic_loads(rng, 200)
    err = np.array([abs(model.predict(x) / true_seconds(model, x) - 1) for x in fresh])
    assert np.median(err) < 0.02 and np.percentile(err, 95) < 0.06, (np.median(err), np.percentile(err, 95))
    # Ordinary least squares on the same data is pulled off by the outliers (why the fit is robust).
    ols = np.linalg.lstsq(with_knee(np.array([model.features(x) for x in loads]), TRUE_KNEE), measured, rcond=None)[0]
    assert np.max(np.abs(ols[[0, 3]] / TRUE[[0, 3]] - 1)) > 0.3


def test_a_long_run_of_one_block_chunks_does_not_make_a_large_chunk_look_cheap():
    """Late in a long prompt under a tight target every step is 16 decodes and a one-block chunk:
    the same tokens each time, so those steps alone cannot tell the token terms from the step term.
    The steps of other sizes seen earlier (warm-up's) stay in the fit, so a large chunk arriving
    after hundreds of one-block steps is still priced near its cost."""
    rng = np.random.default_rng(4)
    model = StepCostModel(refit_every=16)
    for x in synthetic_loads(rng, 64):  # warm-up: steps of many sizes
        model.observe(x, true_seconds(model, x) * float(rng.lognormal(0, 0.03)))
    for i in range(600):  # a 9,600-token prompt one block a step, beside 16 decodes
        x = StepLoad.of([(1, 100 + i)] * 16 + [(BS, BS * i)])
        model.observe(x, true_seconds(model, x) * float(rng.lognormal(0, 0.03)))
    for large in ([(2032, 0)], [(1, 700)] * 16 + [(1024, 3000)]):
        x = StepLoad.of(large)
        assert model.predict(x) == pytest.approx(true_seconds(model, x), rel=0.15)


def test_one_bad_measurement_moves_the_chunk_by_at_most_a_block():
    rng = np.random.default_rng(1)
    model = StepCostModel(window=64, refit_every=1)
    for x in synthetic_loads(rng, 128):
        model.observe(x, true_seconds(model, x) * float(rng.lognormal(0, 0.05)))

    def chunk():
        s = scheduler_with_streams(model, target_ms=60.0)
        return run_long_prefill(s)[0][1][0]

    before = chunk()
    assert 64 <= before < 1000
    probe = StepLoad.of([(1, 100)] * 4 + [(256, 0)])
    for wild in (1e3, 1e-9, 0.0, float("nan"), -1.0):  # a stall, a clock glitch, nonsense
        model.observe(probe, wild)
        assert abs(chunk() - before) <= BS, wild
    assert model.num_rejected == 3


def test_the_margin_is_a_high_quantile_of_measured_over_predicted_and_shrinks_the_chunk():
    """Steps with prefill that run longer than predicted (a scatter around the prediction) give a margin
    near the scatter's 90th percentile; the time budget is the target over it, so chunks shrink; a wild
    measurement barely moves it and a run of them cannot push it past the cap."""
    from paged_jax.step_cost import MAX_MARGIN

    def model_seeing(ratios):
        model = fixed_model()
        model.fit = lambda: None  # keep the fixed coefficients: only the margin learns
        for i, ratio in enumerate(ratios):
            load = StepLoad.of([(1, 10)] * 4 + [(64 + i % 64, 0)])
            model.observe(load, model.predict(load) * ratio)
        return model

    assert fixed_model().margin() == 1.0  # nothing seen yet
    rng = np.random.default_rng(3)
    ratios = rng.lognormal(0, 0.1, 100)
    model = model_seeing(ratios)
    assert model.margin() == pytest.approx(np.quantile(ratios, 0.9)) and 1.08 < model.margin() < 1.2
    assert model_seeing(rng.lognormal(-0.5, 0.05, 100)).margin() == 1.0  # faster than predicted: no margin
    assert abs(model_seeing([*ratios[1:], 50.0]).margin() - model.margin()) < 0.02  # one stall
    assert model_seeing([50.0] * 100).margin() == MAX_MARGIN
    # The chunk: the largest whose prediction stays within target / margin.
    budget_none = StepBudget(tokens=2048, seqs=8, block_size=BS, target_s=10.05e-3, cost=fixed_model())
    budget_margin = StepBudget(tokens=2048, seqs=8, block_size=BS, target_s=10.05e-3, cost=model)
    m = model.margin()
    want = expected_chunk(model.coefficients, 10.05e-3 / m, [], 0, 1000, 2048)
    assert budget_none.take(1000, 0, chunked=True) == 80 and budget_margin.take(1000, 0, chunked=True) == want < 80


def test_robust_nnls_keeps_coefficients_non_negative():
    rng = np.random.default_rng(2)
    x = np.column_stack([np.ones(50), rng.uniform(1, 100, 50)])
    y = 1e-3 + 0 * x[:, 1] + rng.normal(0, 1e-5, 50)  # the slope is zero; noise would make it negative
    b, _ = robust_nnls(x, np.abs(y))
    assert np.all(b >= 0) and abs(b[0] - 1e-3) < 1e-4


# ---- the option --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), "10", True])
def test_target_itl_ms_is_validated_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"target_itl_ms must be None or a positive number.*{bad!r}"
                       .replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(target_itl_ms=bad)
    with pytest.raises(ValueError, match="target_itl_ms"):
        SchedulerConfig(enable_chunked_prefill=True, target_itl_ms=bad)


def test_target_itl_ms_needs_chunked_prefill():
    with pytest.raises(ValueError, match=r"target_itl_ms=20 needs enable_chunked_prefill=True"):
        EngineArgs(target_itl_ms=20, enable_chunked_prefill=False)
    assert EngineArgs(target_itl_ms=12.5).target_itl_ms == 12.5


def test_cli_passes_the_target():
    from paged_jax.cli import build_parser

    a = build_parser().parse_args(["generate", "--target-itl-ms", "25"])
    assert a.target_itl_ms == 25.0
    assert build_parser().parse_args(["generate"]).target_itl_ms is None


# ---- the loop: measured steps in, chunks out -------------------------------------------------------
def test_in_the_simulator_the_fitted_model_keeps_mixed_steps_within_the_target():
    """The real engine over the simulator's roofline executor (a simulated clock): the cost model,
    fitted from the simulated step times alone, sizes the chunks of a long prompt so that the steps
    stay within the target, and every request finishes with all blocks free."""
    from experiments.hardware import SETUPS
    from experiments.simulate import build_engine
    from paged_jax.sampling_params import SamplingParams

    engine, executor, clock = build_engine(SETUPS["opt-13b"], "vllm", enable_chunked_prefill=True,
                                           target_itl_ms=60.0, max_num_batched_tokens=2048)
    assert calibrate(engine)  # what warm-up runs: internal requests, timed on the simulated clock
    assert not engine.has_unfinished_requests() and engine.scheduler_config.target_itl_ms == 60.0
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    for i in range(16):
        engine.add_request(f"s{i}", None, params, prompt_token_ids=[5 + i] * (20 + 10 * i))
    for _ in range(20):
        engine.step()
    engine.add_request("long", None, SamplingParams(max_tokens=1, ignore_eos=True), prompt_token_ids=[3] * 1900)
    durations = []
    while engine.scheduler.running or engine.scheduler.waiting:
        t = clock.now
        outs = engine.step()
        durations.append(clock.now - t)
        engine.block_manager.check_invariants()
        if any(o.request_id == "long" and o.finished for o in outs):
            break
    # The roofline's max(FLOPs, weight reads) fitted with a knee, its attention terms linearly: within 3 %.
    assert max(durations) <= 0.060 * 1.03, durations
    assert len(durations) >= 4  # the prompt was spread over several steps
    stats = engine.get_stats()["step_cost"]
    assert stats["median_relative_error"] < 0.05 and stats["prefill_chunk_tokens"]["max"] > 100, stats
    engine.abort_request([f"s{i}" for i in range(16)])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.get_num_free_gpu_blocks() == engine.block_manager.gpu_allocator.num_total_blocks


# ---- the real engine ---------------------------------------------------------------------------
def run_to_completion(engine, prompts, params) -> dict:
    """Every prompt's output tokens by request id, the block manager's invariants checked after each step."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, params, p)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        engine.block_manager.check_invariants()
    return done


def test_real_engine_with_a_target_gives_the_same_greedy_tokens(tiny_llama_dir):
    from paged_jax import SamplingParams
    from paged_jax.engine import LLMEngine

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (300, 12, 40, 200)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    # 0.05 ms: below any step of a jitted model (0.5 ms was not, on a machine whose small steps ran
    # near it), so once the model is calibrated (as warm-up does), every prompt goes one block per step.
    for target in (None, 0.05):
        engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), max_num_seqs=8, num_kv_blocks=160,
                                      target_itl_ms=target))
        assert calibrate(engine) is (target is not None)
        # The default policy: short prompts first with a target, FCFS without.
        assert type(engine.scheduler.policy).__name__ == ("FCFS" if target is None else "ShortFirst")
        chunks = []  # prefill rows' sizes
        schedule = engine.scheduler.schedule

        def recording():
            out = schedule()
            chunks.extend(r.num_tokens for r in out.scheduled if r.num_tokens > 1)
            return out

        engine.scheduler.schedule = recording
        results[target] = run_to_completion(engine, prompts, params)
        stats = engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert results[0.05] == results[None]
    cost = stats["step_cost"]
    assert stats["target_itl_ms"] == 0.05 and cost["calibrated"] and cost["num_observations"] > 10
    # Calibrated, the target left room for no chunk: each prompt went on one block (16 tokens) per step.
    assert max(chunks) == 16 and sum(chunks) == sum(map(len, prompts)), chunks


def test_metrics_show_the_target_coefficients_error_and_chunks():
    from experiments.hardware import SETUPS
    from experiments.simulate import build_engine
    from paged_jax.server.metrics import ServerMetrics

    def scrape(engine) -> str:
        metrics = ServerMetrics()
        metrics.stats_source = engine.get_stats
        return metrics.render()[0].decode()

    engine, _, _ = build_engine(SETUPS["opt-13b"], "vllm", enable_chunked_prefill=True, target_itl_ms=40.0)
    assert calibrate(engine)
    cost = engine.get_stats()["step_cost"]
    text = scrape(engine)
    assert "paged_jax_target_itl_seconds 0.04" in text
    for term, value in cost["coefficients"].items():
        assert f'paged_jax_step_cost_coefficient{{term="{term}"}} {value!r}' in text
    assert f'paged_jax_prefill_chunk_tokens{{stat="max"}} {float(cost["prefill_chunk_tokens"]["max"])!r}' in text
    assert f"paged_jax_step_cost_prediction_error {cost['median_relative_error']!r}" in text
    plain, _, _ = build_engine(SETUPS["opt-13b"], "vllm", enable_chunked_prefill=True)
    assert plain.get_stats()["step_cost"] is None and "step_cost" not in scrape(plain)


def test_a_decode_runs_even_after_a_prefill_used_the_time():
    """Decodes normally come first; one that comes later (a swapped request returning) still runs."""
    budget = StepBudget(tokens=2048, seqs=8, block_size=BS, target_s=10.05e-3, cost=fixed_model())
    assert budget.take(1000, 0, chunked=True) == 80  # 2 ms + 80 x 0.1 ms within 10.05 ms (a block boundary)
    assert budget.take(500, 0, chunked=True) == 0  # no time left for a second prompt
    assert budget.take(1, 37, chunked=True) == 1  # nor any for a decode, which runs all the same
    assert budget.tokens == 2048 - 81 and budget.load.rows == 2


@pytest.mark.slow
def test_long_prompt_with_prefix_caching_and_preemption_gives_the_same_tokens_with_a_target(tmp_path):
    """A 3,000-token prompt beside others sharing a prefix, in a pool small enough to preempt, with
    prefix caching: the same greedy tokens with a target (calibrated, one block per step) as without."""
    from paged_jax import SamplingParams
    from paged_jax.engine import LLMEngine
    from paged_jax.models.tiny import make_tiny_model

    model = str(make_tiny_model(tmp_path, family="llama", seed=0, max_position_embeddings=4096))
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 500, size=64).tolist()
    prompts = [rng.integers(3, 500, size=3000).tolist()] + [shared + rng.integers(3, 500, size=n).tolist()
                                                            for n in (5, 40, 90)]
    # Preemption whatever the machine's speed: the long prompt prefills at least one block (16 tokens) a
    # step, so it holds its 188 prompt blocks within 188 steps of starting, while the short ones still
    # decode their 200 tokens and hold 50 blocks or more by then: over the 220 in the pool.
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    results, preemptions = {}, {}
    for target in (None, 1.0):
        engine = LLMEngine(EngineArgs(model=model, max_num_seqs=4, num_kv_blocks=220, enable_prefix_caching=True,
                                      target_itl_ms=target))
        calibrate(engine)
        results[target] = run_to_completion(engine, prompts, params)
        preemptions[target] = sum(engine.get_stats()["num_preemptions"].values())
    assert results[1.0] == results[None] and len(results[None]) == 4
    assert preemptions[1.0] > 0
