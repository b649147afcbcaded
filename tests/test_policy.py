"""Scheduling policies as objects: a custom policy is one small class, and the scheduler
follows its answers (admission order, service order, preemption victim)."""

from __future__ import annotations

import pytest

from paged_jax.policy import FCFS, SchedulingPolicy
from tests.test_scheduler import advance, group, make, run_to_end


class ShortestPromptFirst(SchedulingPolicy):
    def next_waiting(self, waiting):
        return min(waiting, key=lambda g: g.seqs[0].get_prompt_len())


class Priority(SchedulingPolicy):
    """Lower number = more important: served first, admitted first, preempted last."""

    def __init__(self, priority: dict[str, int]):
        self.priority = priority

    def _key(self, g):
        return self.priority[g.request_id]

    def next_waiting(self, waiting):
        return min(waiting, key=self._key)

    def order_running(self, running):
        return sorted(running, key=self._key)

    def choose_victim(self, candidates):
        return max(candidates, key=self._key)


def admitted_order(sched):
    """Request ids in the order they were first scheduled, running the queue to the end."""
    order = []
    for out in run_to_end(sched):
        order += [r.group.request_id for r in out.scheduled if r.group.request_id not in order]
    return order


def test_custom_policy_sets_the_admission_order():
    lens = {"a": 9, "b": 3, "c": 6, "d": 1, "e": 4}
    orders = {}
    for policy in (FCFS(), ShortestPromptFirst()):
        s = make(max_num_seqs=1, policy=policy)  # one at a time: the admission order is the serving order
        for rid, n in lens.items():
            s.add_seq_group(group(rid, n, max_tokens=2))
        orders[type(policy).__name__] = admitted_order(s)
    assert orders["FCFS"] == ["a", "b", "c", "d", "e"]
    assert orders["ShortestPromptFirst"] == sorted(lens, key=lens.get) == ["d", "b", "e", "c", "a"]


def test_admission_stops_at_the_policy_choice_that_does_not_fit():
    # 16 usable blocks of 4 tokens. The policy's first pick (the shortest prompt, 4 blocks) fits,
    # its second (13 blocks) does not once the first holds its blocks: it waits, and nothing else
    # is tried in its place.
    s = make(num_blocks=17, policy=ShortestPromptFirst())
    for rid, n in (("big", 60), ("mid", 50), ("small", 16)):
        s.add_seq_group(group(rid, n, max_tokens=2))
    out = s.schedule()
    assert [r.group.request_id for r in out.scheduled] == ["small"]
    assert [g.request_id for g in s.waiting] == ["big", "mid"]


def test_priority_policy_serves_and_preempts_by_priority():
    # 6 usable blocks of 4 tokens: three requests of 8-token prompts take them all, and each needs
    # a third block at its 9th token. The first one served must preempt one of the other two.
    prio = {"low": 2, "high": 0, "mid": 1}
    s = make(num_blocks=7, policy=Priority(prio), preemption_mode="recompute")
    for rid in ("low", "high", "mid"):  # arrival order differs from priority
        s.add_seq_group(group(rid, 8, max_tokens=6))
    first = s.schedule()
    assert [r.group.request_id for r in first.scheduled] == ["high", "mid", "low"]
    advance(s, first)
    assert [g.request_id for g in s.running] == ["high", "mid", "low"]
    second = s.schedule()
    # FCFS would preempt the newest arrival ("mid"); the priority policy preempts "low".
    assert [(g.request_id, m.value) for g, m in second.preempted] == [("low", "recompute")]
    assert [r.group.request_id for r in second.scheduled] == ["high", "mid"]
    advance(s, second)
    assert [r.group.request_id for r in run_to_end(s)[-1].scheduled] == ["low"]


class PreemptOldest(SchedulingPolicy):
    def choose_victim(self, candidates):
        return candidates[0]


class ServeNewestFirst(SchedulingPolicy):
    def order_running(self, running):
        return running[::-1]


@pytest.mark.parametrize("policy,served,preempted", [
    (FCFS(), ["a", "b"], ["c"]),  # a served first, preempts the newest (c)
    (PreemptOldest(), ["a", "c"], ["b"]),  # a served first, preempts the oldest of the others (b)
    (ServeNewestFirst(), ["c", "b"], ["a"]),  # c served first, preempts the last of its order (a)
])
def test_service_order_and_victim_are_the_policy_s(policy, served, preempted):
    # The setting above: 6 blocks, all held, each of a, b, c needs one more.
    s = make(num_blocks=7, policy=policy, preemption_mode="recompute")
    for rid in ("a", "b", "c"):
        s.add_seq_group(group(rid, 8, max_tokens=6))
    advance(s, s.schedule())
    out = s.schedule()
    assert [r.group.request_id for r in out.scheduled] == served
    assert [g.request_id for g, _ in out.preempted] == preempted


def test_static_admission_hook_holds_new_requests_until_the_batch_ends():
    class OneBatchAtATime(SchedulingPolicy):
        def admission_open(self, running):
            return not running

    s = make(max_num_seqs=2, policy=OneBatchAtATime())
    for rid, out_len in (("a", 2), ("b", 5), ("c", 1)):
        s.add_seq_group(group(rid, 4, max_tokens=out_len))
    steps = [{r.group.request_id for r in out.scheduled} for out in run_to_end(s)]
    assert steps == [{"a", "b"}, {"a", "b"}] + [{"b"}] * 3 + [{"c"}]


def test_a_policy_choosing_outside_its_candidates_is_refused():
    class Wrong(SchedulingPolicy):
        def next_waiting(self, waiting):
            return group("stranger", 3)

    s = make(policy=Wrong())
    s.add_seq_group(group("a", 3))
    with pytest.raises(ValueError, match="policy's next_waiting returned request 'stranger', which is not one"):
        s.schedule()


def test_the_scheduler_reads_the_policy_it_holds():
    """A built engine's policy can be swapped between runs (the throughput benchmark does)."""
    s = make(max_num_seqs=1)
    assert type(s.policy) is FCFS
    s.policy = ShortestPromptFirst()
    for rid, n in (("long", 8), ("short", 2)):
        s.add_seq_group(group(rid, n, max_tokens=1))
    assert admitted_order(s) == ["short", "long"]


# --- choosing the policy as an engine option -------------------------------------------------------

def test_scheduling_policy_is_an_engine_option_by_name_or_object(tiny_llama_dir):
    """``LLM(scheduling_policy=...)``: by name, the paper's Orca(Max) baseline admits only as many
    requests as max_model_len reservations fit in the pool (4 here), where FCFS admits all 8; a
    policy object of one's own is the one the scheduler holds; every block is free at the end."""
    from paged_jax import LLM, SamplingParams
    from paged_jax.policy import Orca

    params = SamplingParams(temperature=0, max_tokens=4)
    admitted = {}
    for policy in ("fcfs", "orca-max"):
        # 32 usable blocks of 4 tokens = 4 reservations of max_model_len 32
        llm = LLM(str(tiny_llama_dir), max_model_len=32, block_size=4, num_kv_blocks=33, scheduling_policy=policy)
        engine = llm.llm_engine
        for i in range(8):
            engine.add_request(f"r{i}", None, params, prompt_token_ids=[1, 2, 3 + i])
        engine.step()
        admitted[policy] = len(engine.scheduler.running)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.block_manager.get_num_free_gpu_blocks() == 32
    assert admitted == {"fcfs": 8, "orca-max": 4}
    assert isinstance(engine.scheduler.policy, Orca) and engine.scheduler.policy.mode == "max"
    own = ShortestPromptFirst()
    assert LLM(str(tiny_llama_dir), max_model_len=32, scheduling_policy=own).llm_engine.scheduler.policy is own


def test_an_unknown_scheduling_policy_is_refused_by_name_before_loading():
    from paged_jax.engine_args import EngineArgs
    from paged_jax.policy import POLICIES

    with pytest.raises(ValueError, match=r"scheduling_policy must be None, one of \['fcfs', 'orca-max'.*got 'lifo'"):
        EngineArgs(model="/nonexistent", scheduling_policy="lifo")
    assert set(POLICIES) == {"fcfs", "orca-max", "orca-pow2", "orca-oracle", "fastertransformer", "short-first"}


def test_the_command_line_takes_the_scheduling_policy():
    from paged_jax.cli import build_parser

    a = build_parser().parse_args(["generate", "--scheduling-policy", "fastertransformer"])
    assert a.scheduling_policy == "fastertransformer"
    assert build_parser().parse_args(["serve"]).scheduling_policy is None  # fcfs, or short-first with a target
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--scheduling-policy", "lifo"])
