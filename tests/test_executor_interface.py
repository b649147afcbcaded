"""The executor border: the engine decides what each row's samples mean (how many, their seeds,
candidates, logprobs, prompt logprobs) and hands plain data to any Executor; the border's
modules import no JAX."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_jax.beam_search import num_candidates
from paged_jax.engine import LLMEngine
from paged_jax.executor.interface import Executor, RowSampling, Sample, StepResult, check_sampling
from paged_jax.memory.block_manager import BlockManager
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import SchedulerConfig, SchedulerOutput
from paged_jax.seeds import seed_for_sample

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 100
EOS = 0


class RecordingExecutor:
    """Implements Executor: records what each step asked for and answers it with fixed tokens."""

    def __init__(self):
        self.timings = {"fake": 0.0}
        self.calls: list[tuple[SchedulerOutput, list[RowSampling]]] = []

    @property
    def num_compilations(self) -> int:
        return 0

    def warm_up(self, max_num_seqs, max_num_batched_tokens, max_model_len, sampling_params=None,
                eos_token_id=None, progress=True) -> int:
        return 0

    def execute(self, out, sampling=(), eos_token_id=None) -> StepResult:
        check_sampling(out, sampling)
        self.calls.append((out, list(sampling)))
        result = StepResult()
        for i, spec in enumerate(sampling):
            k = spec.num_candidates
            cands = (list(range(10, 10 + k)), [-1.0 - j for j in range(k)]) if k else None
            if spec.seeds:
                result.samples[i] = [Sample(10, -1.0, None, cands) for _ in spec.seeds]
            if spec.prompt_logprobs is not None:
                result.prompt_logprobs[i] = []
        return result

    def asked(self, request_id: str) -> list[list[RowSampling]]:
        """Per step that ran this request: its rows' RowSamplings."""
        steps = []
        for out, sampling in self.calls:
            rows = [s for r, s in zip(out.scheduled, sampling) if r.group.request_id == request_id]
            if rows:
                steps.append(rows)
        return steps


def make_engine(chunked: bool = False, budget: int = 64):
    executor = RecordingExecutor()
    config = SchedulerConfig(8, budget, 64, None, chunked)
    engine = LLMEngine.from_components(config, BlockManager(4, 64, 0), executor, VOCAB, eos_token_id=EOS)
    return engine, executor


def run(engine):
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
    return outputs


def run_python(code: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def test_border_modules_import_without_jax():
    code = ("import sys, paged_jax.executor.interface, paged_jax.seeds, paged_jax.engine, paged_jax.scheduler; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))[:5]")
    run_python(code)


def test_simulator_does_not_import_the_model_runner():
    code = ("import sys, experiments.sim_executor; "
            "assert 'paged_jax.executor.model_runner' not in sys.modules")
    run_python(code)


def test_executors_implement_the_protocol():
    from experiments.cost_model import CostModel
    from experiments.hardware import SETUPS
    from experiments.sim_executor import SimClock, SimulatedExecutor

    assert isinstance(RecordingExecutor(), Executor)
    sim = SimulatedExecutor(CostModel(next(iter(SETUPS.values())), 16), SimClock())
    assert isinstance(sim, Executor)
    assert not isinstance(object(), Executor)


def test_best_of_asks_for_best_of_samples_on_the_first_token_then_one_each():
    engine, executor = make_engine()
    engine.add_request("r", None, SamplingParams(n=2, best_of=3, seed=5, max_tokens=3, ignore_eos=True,
                                                 temperature=0.8), prompt_token_ids=[1, 2, 3, 4, 5])
    out = run(engine)["r"]
    steps = executor.asked("r")
    assert len(steps) == 3
    # The prompt's step: one row drawing best_of samples, seeded per sample index.
    assert [s.seeds for s in steps[0]] == [tuple(seed_for_sample(5, j) for j in range(3))]
    # Afterwards: the three samples each draw once, with their own sample's seed.
    for rows in steps[1:]:
        assert sorted(s.seeds for s in rows) == sorted((seed_for_sample(5, j),) for j in range(3))
    assert all(s.num_candidates == 0 and s.logprobs is None for rows in steps for s in rows)
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 3 for c in out.outputs)


def test_unseeded_samples_and_logprobs_are_passed_through():
    engine, executor = make_engine()
    engine.add_request("r", None, SamplingParams(n=2, temperature=1.0, max_tokens=2, ignore_eos=True, logprobs=3),
                       prompt_token_ids=[1, 2, 3])
    run(engine)
    steps = executor.asked("r")
    assert [s.seeds for s in steps[0]] == [(None, None)]
    assert [s.seeds for s in steps[1]] == [(None,), (None,)]
    assert all(s.logprobs == 3 and s.num_top == 3 for rows in steps for s in rows)


@pytest.mark.parametrize("logprobs", [None, 9])
def test_beam_rows_ask_for_candidates_and_one_sample(logprobs):
    engine, executor = make_engine()
    p = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=3, logprobs=logprobs)
    engine.add_request("r", None, p, prompt_token_ids=[1, 2, 3])
    run(engine)
    want = max(num_candidates(2, 1), logprobs or 0)  # one stop token: EOS
    steps = executor.asked("r")
    assert [len(rows) for rows in steps] == [1, 2, 2]  # the prompt, then the two beams
    assert all(s.seeds == (None,) and s.num_candidates == want for rows in steps for s in rows)


def test_prompt_logprobs_are_asked_for_rows_running_prompt_tokens():
    engine, executor = make_engine(chunked=True, budget=4)
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2),
                       prompt_token_ids=list(range(1, 11)))
    run(engine)
    steps = [rows[0] for rows in executor.asked("r")]
    # Chunks of 4, 4 and 2 prompt tokens (the last one samples), then one decode step.
    assert [s.prompt_logprobs for s in steps] == [2, 2, 2, None]
    assert [s.num_samples for s in steps] == [0, 0, 1, 1]


def test_row_sampling_and_check_sampling_reject_bad_values():
    with pytest.raises(ValueError, match="num_candidates must be >= 0, got -1"):
        RowSampling(SamplingParams(), num_candidates=-1)
    with pytest.raises(ValueError, match="one RowSampling per scheduled row: got 0 for 1 rows"):
        engine, _ = make_engine()
        engine.add_request("r", None, SamplingParams(max_tokens=1), prompt_token_ids=[1, 2])
        check_sampling(engine.scheduler.schedule(), [])


def test_model_runner_draws_exactly_what_each_row_asks(tiny_llama_dir):
    """Row A completes its prompt and asks for 3 greedy samples with logprobs and 4 candidates;
    row B runs the first 5 of its 8 prompt tokens and asks for prompt logprobs only. Oracle:
    numpy log-softmax over the logits of a plain prefill of the same prompts."""
    import numpy as np

    from paged_jax.executor.model_runner import ModelRunner
    from paged_jax.models.loader import load_model
    from paged_jax.scheduler import ScheduledSeq
    from paged_jax.sequence import Sequence, SequenceGroup
    from tests.model_helpers import PagedRunner

    config, params = load_model(tiny_llama_dir)
    prompt_a, prompt_b = [5, 9, 13, 2, 7, 11], [3, 4, 8, 21, 6, 30, 12, 17]
    logits_a, logits_b = PagedRunner(config, params).prefill_logits([prompt_a, prompt_b])

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        return x - x.max() - np.log(np.exp(x - x.max()).sum())

    greedy = SamplingParams(temperature=0, logprobs=2, prompt_logprobs=3)
    a, b = Sequence(0, prompt_a), Sequence(1, prompt_b)
    out = SchedulerOutput(scheduled=[
        ScheduledSeq(a, SequenceGroup("a", [a], greedy, 0.0, None), len(prompt_a), [1, 2]),
        ScheduledSeq(b, SequenceGroup("b", [b], greedy, 0.0, None), 5, [3, 4])])
    sampling = [RowSampling(greedy, (None, None, None), logprobs=2, num_candidates=4),
                RowSampling(greedy, (), prompt_logprobs=3)]
    runner = ModelRunner(config, params, 4, 16, 0)
    assert isinstance(runner, Executor)
    result = runner.execute(out, sampling, eos_token_id=None)

    lp_a = log_softmax(logits_a[-1])
    best = np.argsort(-lp_a)
    assert set(result.samples) == {0} and len(result.samples[0]) == 3
    for smp in result.samples[0]:
        assert smp.token_id == best[0] and smp.logprob == pytest.approx(lp_a[best[0]], abs=1e-4)
        assert set(smp.logprobs) == {int(t) for t in best[:2]}
        ids, lps = smp.candidates
        assert ids == [int(t) for t in best[:4]] and lps == pytest.approx(lp_a[best[:4]], abs=1e-4)
    assert set(result.prompt_logprobs) == {1}
    entries = result.prompt_logprobs[1]
    assert len(entries) == 5  # positions 0..4 score prompt tokens 1..5
    for p, entry in enumerate(entries):
        lp = log_softmax(logits_b[p])
        target = prompt_b[p + 1]
        assert entry[target] == pytest.approx(lp[target], abs=1e-4)
        assert {int(t) for t in np.argsort(-lp)[:3]} <= set(entry)
