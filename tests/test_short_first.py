"""Short prompts first (:class:`paged_jax.policy.ShortFirst`): among partly prefilled and waiting prompts,
the fewest tokens left go first; a prompt skipped ``max_skipped_steps`` steps in a row goes before all.

Scheduler-level tests with a deterministic cost model (fixed coefficients) and steps as the clock (the
arrival times are step numbers): no timing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.policy import FCFS, ShortFirst, make_policy
from paged_jax.sequence import SequenceStatus
from tests.test_latency_target import fixed_model, make
from tests.test_scheduler import advance, group


def scheduler(policy, target_ms=None, budget=256, num_blocks=600, **cfg):
    return make(num_blocks=num_blocks, max_model_len=4096, max_num_batched_tokens=budget, enable_chunked_prefill=True,
                target_itl_ms=target_ms, step_cost=None if target_ms is None else fixed_model(), policy=policy, **cfg)


def first_token_steps(s, arrivals: dict[int, list], limit=3000) -> dict[str, int]:
    """Run ``s``, adding ``arrivals[step]``'s groups at that step; the step at which each request's prompt
    was all computed (its first token), by request id. Checks that no decode is ever held back."""
    done, step = {}, 0
    while step in arrivals or any(k > step for k in arrivals) or s.has_unfinished_seqs():
        for g in arrivals.get(step, []):
            s.add_seq_group(g)
        out = s.schedule()
        running = [g for g in s.running if not g.is_finished()]
        for r in out.scheduled:
            if r.completes and r.group.request_id not in done:
                done[r.group.request_id] = step
        # Every running request with one token to compute got it.
        decoding = [g for g in running if all(x.num_uncomputed_tokens == 1 for x in g.get_seqs(SequenceStatus.RUNNING))]
        assert {id(g) for g in decoding} <= {id(r.group) for r in out.scheduled}
        advance(s, out)
        step += 1
        assert step < limit, "did not finish"
    return done


@pytest.mark.parametrize("target_ms", [None, 20.05])
def test_a_short_prompt_arriving_during_a_long_prefill_starts_at_once(target_ms):
    """FCFS makes a short prompt wait for the whole long prefill; short-first serves it within a step,
    with or without a latency target; the long prompt still finishes."""
    def run(policy):
        s = scheduler(policy, target_ms)
        arrivals = {0: [group("long", 3000, max_tokens=2, arrival=0)],
                    3: [group("short", 100, max_tokens=2, arrival=3)]}
        return first_token_steps(s, arrivals)

    fcfs, short_first = run(FCFS()), run(ShortFirst())
    assert fcfs["short"] >= fcfs["long"] > 10  # today: behind the whole long prompt
    assert short_first["short"] <= 3 + 1  # its 100 tokens fit in one step (two with the target's 180 tokens)
    assert short_first["long"] <= fcfs["long"] + 2  # the long prompt loses about the short one's step


def test_shorter_remainders_go_first_within_the_budget():
    """Running and waiting prompts in one order by tokens left: a long prompt part-way through and three
    waiting ones; the budget (256 tokens) goes to the shortest remainders first."""
    s = scheduler(ShortFirst(), budget=256)
    s.add_seq_group(group("a", 1000, arrival=0))
    advance(s, s.schedule())  # "a" takes 256 tokens
    for rid, n, t in (("b", 400, 1), ("c", 50, 2), ("d", 700, 3)):
        s.add_seq_group(group(rid, n, arrival=t))
    out = s.schedule()
    # Tokens left: c 50, b 400, d 700, a 744: c whole, then b the remaining 206; d waits, a gets none.
    assert [(r.group.request_id, r.num_tokens) for r in out.scheduled] == [("c", 50), ("b", 206)]
    advance(s, out)
    out = s.schedule()
    # c decodes first (decodes always do), then b's last 194, then d (700 < a's 744) the rest, 61.
    assert [(r.group.request_id, r.num_tokens) for r in out.scheduled] == [("c", 1), ("b", 194), ("d", 61)]


def test_a_running_prompt_keeps_its_place_within_max_num_seqs():
    """Short waiting prompts go before a running long one, but cannot take its place: with two places,
    one short prompt is admitted beside it, not two."""
    s = scheduler(ShortFirst(), budget=64, max_num_seqs=2)
    s.add_seq_group(group("long", 1000, arrival=0))
    advance(s, s.schedule())
    s.add_seq_group(group("c", 20, arrival=1))
    s.add_seq_group(group("d", 30, arrival=2))
    out = s.schedule()
    assert [(r.group.request_id, r.num_tokens) for r in out.scheduled] == [("c", 20), ("long", 44)]
    assert [g.request_id for g in s.running] == ["c", "long"] and [g.request_id for g in s.waiting] == ["d"]


def test_a_long_prompt_behind_a_stream_of_short_ones_still_progresses_by_aging():
    """Short prompts arriving every step fill every step's budget: without aging the long prompt would
    wait for the stream to end; with it, it gets tokens at least once every max_skipped_steps + 1 steps."""
    def run(max_skipped):
        s = scheduler(ShortFirst(max_skipped_steps=max_skipped), budget=128, num_blocks=2000)
        arrivals = {0: [group("long", 1000, max_tokens=1, arrival=0)]}
        for t in range(1, 200):  # each 128 tokens: the whole budget
            arrivals[t] = [group(f"s{t}", 128, max_tokens=1, arrival=t)]
        progress, step, gaps, last = {}, 0, [], 0
        while s.has_unfinished_seqs() or step in arrivals:
            for g in arrivals.get(step, []):
                s.add_seq_group(g)
            out = s.schedule()
            if any(r.group.request_id == "long" for r in out.scheduled):
                gaps.append(step - last)
                last = step
            for r in out.scheduled:
                if r.completes:
                    progress.setdefault(r.group.request_id, step)
            advance(s, out)
            step += 1
        return progress["long"], max(gaps)

    done, gap = run(4)
    assert gap <= 4 + 1 and done < 200  # finished while the short prompts kept coming
    starved, _ = run(10_000)  # no aging to speak of: the stream of short prompts goes first
    assert starved >= 200


@pytest.mark.parametrize("max_skipped", [2, 10_000])
def test_an_aged_prompt_that_does_not_fit_in_memory_stops_admission_behind_it(max_skipped):
    """Short prompts arriving every step keep the KV cache full; a long prompt that does not fit would
    be overtaken by short ones whenever blocks free (10,000: no aging to speak of). Aged, admission
    stops at it until the running requests free enough blocks."""
    s = scheduler(ShortFirst(max_skipped_steps=max_skipped), budget=512, num_blocks=40)  # blocks of 16 tokens
    arrivals = {12: [group("long", 300, max_tokens=1, arrival=12)]}  # 19 blocks, when the cache is full
    for t in range(80):
        arrivals.setdefault(t, []).append(group(f"s{t}", 30, max_tokens=30, arrival=t))  # up to 4 blocks each
    done = first_token_steps(s, arrivals)
    last_short = max(v for k, v in done.items() if k.startswith("s"))
    if max_skipped == 2:
        assert done["long"] < 60 < last_short  # admitted once the shorts then running ended, while more came
    else:
        assert done["long"] > 80  # after the stream of short prompts: starved while it lasted


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 600), st.integers(1, 6)), min_size=1, max_size=14),
       st.sampled_from([None, 3.0, 25.0]), st.sampled_from(["recompute", "swap"]), st.integers(1, 6))
def test_random_arrivals_no_starvation_no_lost_request_or_block(arrivals, target_ms, mode, max_skipped):
    """Random arrivals into a small pool (preemption by recompute or swap), with or without a target:
    every request finishes, every block comes back, and no prompt goes without tokens for more steps
    than aging allows (each aged prompt ahead of it gets served first; the rest of the budget goes on)."""
    s = make(num_blocks=64, cpu_blocks=64, max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=6,
             enable_chunked_prefill=True, target_itl_ms=target_ms, policy=ShortFirst(max_skipped),
             step_cost=None if target_ms is None else fixed_model(), preemption_mode=mode)
    pending = sorted(((at, n, m, f"r{i}") for i, (at, n, m) in enumerate(arrivals)), reverse=True)
    groups, step, skipped = [], 0, {}
    while pending or s.has_unfinished_seqs():
        while pending and pending[-1][0] <= step:
            at, n, m, rid = pending.pop()
            groups.append(group(rid, n, max_tokens=m, arrival=at))
            s.add_seq_group(groups[-1])
        out = s.schedule()
        assert sum(g.num_seqs(SequenceStatus.RUNNING) for g in s.running) <= 6  # max_num_seqs
        served = {r.group.request_id for r in out.scheduled}
        prompts = [g for g in list(s.waiting) + s.running if g.seqs[0].num_uncomputed_tokens > 1]
        for g in prompts:
            skipped[g.request_id] = 0 if g.request_id in served else skipped.get(g.request_id, 0) + 1
        advance(s, out)
        step += 1
        assert step < 3000, "starved"
    # A prompt waits for at most every other request's aging turn plus its own.
    assert max(skipped.values(), default=0) <= (max_skipped + 1) * len(groups), skipped
    assert all(g.is_finished() for g in groups)
    assert not any(seq.status is SequenceStatus.FINISHED_IGNORED for g in groups for seq in g.seqs)
    bm = s.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.gpu_allocator.num_total_blocks
    assert bm.get_num_free_cpu_blocks() == bm.cpu_allocator.num_total_blocks


def test_short_first_is_a_policy_by_name_with_its_own_state_and_validated():
    a, b = make_policy("short-first"), make_policy("short-first")
    assert isinstance(a, ShortFirst) and a is not b and a.max_skipped_steps == 16
    # The engine's default (scheduling_policy=None): FCFS without a latency target, short-first with one.
    assert type(make_policy(None)) is FCFS and type(make_policy(None, target_itl_ms=20.0)) is ShortFirst
    assert type(make_policy("fcfs", target_itl_ms=20.0)) is FCFS
    with pytest.raises(ValueError, match="max_skipped_steps must be a positive integer, got 0"):
        ShortFirst(0)


def test_a_policy_order_leaving_out_a_running_prompt_is_refused_and_loses_nothing():
    class Forgetful(ShortFirst):
        def order_prefills(self, prefilling, waiting):
            return list(waiting)

    s = scheduler(Forgetful(), budget=64)
    s.add_seq_group(group("a", 200))
    advance(s, s.schedule())
    with pytest.raises(ValueError, match="order_prefills left out a running request"):
        s.schedule()
    assert [g.request_id for g in s.running] == ["a"]
