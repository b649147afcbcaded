"""Scheduling policies: the decisions :class:`paged_jax.scheduler.Scheduler` leaves open.

The scheduler owns the mechanics of an iteration (token budget, blocks,
preemption, swapping); a policy answers its questions:

- ``next_waiting(waiting)``: which waiting request is admitted next. Admission
  stops at the first one that does not fit (no request overtakes it).
- ``order_running(running)``: the order running requests are served in.
- ``choose_victim(candidates)``: which request is preempted when the one being
  served needs blocks that are not there; the candidates are the running
  requests not yet served this iteration (when there are none, the request being
  served is preempted itself).
- ``reservation(group, max_model_len)``: KV tokens a request reserves at
  admission (none: blocks are allocated on demand as it grows).
- ``admission_open(running)``: whether new requests may be admitted this iteration.
- ``order_prefills(prefilling, waiting)`` (chunked prefill): one order over the partly
  prefilled running requests and the waiting ones, in which they get the prompt tokens
  the decodes leave; None (the default): the running ones first, then swapped ones, then
  waiting ones in ``next_waiting``'s order.

Swapped-out requests come back oldest first (by arrival time) under every policy.

:class:`FCFS` (vLLM's policy) is the default. The paper's baselines (Sec. 6.1),
used by the simulator in ``experiments/``, are policies beside it, and :class:`ShortFirst`
serves short prompts before long ones (the default with a latency target, ``target_itl_ms``):
:class:`Orca` reserves each request's KV space at admission, and
:class:`FasterTransformer` adds static batching. A new policy is a subclass of
:class:`SchedulingPolicy` that overrides what it changes, e.g. shortest prompt
first::

    class ShortestPromptFirst(SchedulingPolicy):
        def next_waiting(self, waiting):
            return min(waiting, key=lambda g: g.seqs[0].get_prompt_len())

    LLM(model, scheduling_policy=ShortestPromptFirst())  # or SchedulerConfig(policy=ShortestPromptFirst())

The built-in ones also go by name (:data:`POLICIES`: ``scheduling_policy="orca-max"``, the
command line's ``--scheduling-policy``).

Plain Python, no JAX, like the scheduler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, Optional

from paged_jax.sequence import SequenceGroup, SequenceStatus
from paged_jax.utils import pow2_bucket


class Reservation(NamedTuple):
    """KV tokens a request reserves at admission: ``asked`` by the policy, ``allocated``
    after rounding (a buddy allocator's power of two). (0, 0): nothing reserved."""

    asked: int
    allocated: int


NO_RESERVATION = Reservation(0, 0)


class SchedulingPolicy:
    """The scheduler's questions, answered first come first served with KV blocks on
    demand (vLLM): waiting requests are admitted in queue order (arrival order, with
    requests preempted by recompute put back in front), running ones are served in
    the order they started, and the last of them is preempted first. Subclasses
    override what they change."""

    def next_waiting(self, waiting: Sequence[SequenceGroup]) -> SequenceGroup:
        return waiting[0]

    def order_running(self, running: list[SequenceGroup]) -> list[SequenceGroup]:
        return running

    def choose_victim(self, candidates: Sequence[SequenceGroup]) -> SequenceGroup:
        return candidates[-1]

    def reservation(self, group: SequenceGroup, max_model_len: int) -> Reservation:
        return NO_RESERVATION

    def admission_open(self, running: list[SequenceGroup]) -> bool:
        return True

    def order_prefills(self, prefilling: list[SequenceGroup],
                       waiting: Sequence[SequenceGroup]) -> Optional[list[SequenceGroup]]:
        """With chunked prefill: the order in which ``prefilling`` (running requests with prompt
        tokens left, in ``order_running``'s order) and ``waiting`` requests get the step's tokens left
        after the decodes; every one of ``prefilling`` must be in it. A waiting request is admitted
        when its turn comes (unless admission is closed this step); one that does not fit stops
        admission, as with ``next_waiting``. None: ``prefilling`` first, then swapped requests, then
        the waiting ones in ``next_waiting``'s order."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFS(SchedulingPolicy):
    """First come first served: the default policy, every answer as the base class gives it."""


RESERVATIONS = ("max", "pow2", "oracle")


class Orca(SchedulingPolicy):
    """Orca (paper Sec. 6.1): FCFS, each request's KV space reserved at admission.

    ``reservation``: ``"max"`` reserves ``max_model_len`` tokens, ``"pow2"`` the
    prompt plus the next power of two of the true output length, ``"oracle"`` the
    prompt plus the true output length (the true output length is ``max_tokens``,
    known to the simulator; with ``max_tokens=None`` every mode reserves
    ``max_model_len``). ``buddy_allocator`` rounds each reservation up to a power
    of two, as a buddy allocator does.
    """

    def __init__(self, reservation: str = "max", buddy_allocator: bool = False):
        if reservation not in RESERVATIONS:
            raise ValueError(f"reservation must be one of {RESERVATIONS}, got {reservation!r}")
        if not isinstance(buddy_allocator, bool):
            raise ValueError(f"buddy_allocator must be True or False, got {buddy_allocator!r}")
        self.mode = reservation
        self.buddy_allocator = buddy_allocator

    def reservation(self, group: SequenceGroup, max_model_len: int) -> Reservation:
        seq = group.seqs[0]
        out_len: Optional[int] = group.sampling_params.max_tokens
        if self.mode == "max" or out_len is None:
            asked = max_model_len
        else:
            asked = min(max_model_len,
                        seq.get_prompt_len() + (pow2_bucket(out_len) if self.mode == "pow2" else out_len))
        asked = max(asked, seq.get_len())
        return Reservation(asked, pow2_bucket(asked) if self.buddy_allocator else asked)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mode!r}, buddy_allocator={self.buddy_allocator})"


class FasterTransformer(Orca):
    """FasterTransformer (paper Sec. 6.1): Orca's reservation (``"max"`` by default)
    with static batching: a new batch is admitted only once every request of the
    last one has finished."""

    def admission_open(self, running: list[SequenceGroup]) -> bool:
        return not running


class ShortFirst(SchedulingPolicy):
    """Short prompts first (chunked prefill): among the partly prefilled and the waiting prompts,
    those with the fewest tokens left to prefill get the step's prompt tokens first (ties in
    arrival order), so a short prompt arriving while a long one prefills starts at once instead of
    waiting for it. The engine's default with a latency target (``target_itl_ms``).

    Anti-starvation, by aging: a prompt that got no prompt tokens in ``max_skipped_steps``
    consecutive steps goes before all the others (such prompts among themselves oldest first) until
    it gets some. Aging by progress rather than by time since arrival: a long prompt that keeps
    getting the tokens short ones leave does not jump the queue (which would put every short prompt
    arriving later behind its whole prefill); it only does when short prompts take every step, and
    then it gets at least one step in ``max_skipped_steps + 1``. Counting steps, not seconds, keeps
    the rule independent of how long steps are. An aged waiting prompt that does not fit in the KV
    cache stops admission behind it (no later prompt overtakes it), so memory cannot starve it either.

    Without chunked prefill a prompt runs whole and this is FCFS. It keeps a count per prompt:
    one instance per scheduler (``make_policy("short-first")`` makes a new one).
    """

    def __init__(self, max_skipped_steps: int = 16):
        if not isinstance(max_skipped_steps, int) or isinstance(max_skipped_steps, bool) or max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps must be a positive integer, got {max_skipped_steps!r}")
        self.max_skipped_steps = max_skipped_steps
        self._seen: dict[int, tuple[SequenceGroup, int, int]] = {}  # id(group) -> (group, tokens computed, skipped)

    def skipped_steps(self, group: SequenceGroup) -> int:
        """Consecutive steps ``group`` has been a candidate without getting prompt tokens."""
        return self._seen.get(id(group), (None, 0, 0))[2]

    def order_prefills(self, prefilling, waiting):
        seen, self._seen = self._seen, {}
        for group in (*prefilling, *waiting):
            computed = sum(s.num_computed_tokens for s in group.seqs)
            old = seen.get(id(group))
            # Progress since the last step resets the count; a group seen for the first time starts at 0.
            skipped = 0 if old is None or old[0] is not group or computed > old[1] else old[2] + 1
            self._seen[id(group)] = (group, computed, skipped)

        def key(group):
            aged = self._seen[id(group)][2] >= self.max_skipped_steps
            left = 0 if aged else sum(s.num_uncomputed_tokens for s in group.get_unfinished_seqs())
            return (not aged, left, group.arrival_time)

        return sorted((*prefilling, *waiting), key=key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_skipped_steps={self.max_skipped_steps})"


# The built-in policies by name, for EngineArgs.scheduling_policy and the command line.
POLICIES = {
    "fcfs": FCFS,
    "orca-max": lambda: Orca("max"),
    "orca-pow2": lambda: Orca("pow2"),
    "orca-oracle": lambda: Orca("oracle"),
    "fastertransformer": FasterTransformer,
    "short-first": ShortFirst,
}


def make_policy(policy, target_itl_ms: Optional[float] = None) -> SchedulingPolicy:
    """``policy`` itself when it is a :class:`SchedulingPolicy`, else the built-in one of that name
    (:data:`POLICIES`); None: ``"fcfs"``, or ``"short-first"`` with a latency target (``target_itl_ms``:
    a user who asks for short gaps wants short prompts not stuck behind long ones either). ValueError
    naming the allowed values otherwise."""
    if policy is None:
        policy = "fcfs" if target_itl_ms is None else "short-first"
    if isinstance(policy, SchedulingPolicy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise ValueError(f"scheduling_policy must be None, one of {list(POLICIES)} or a paged_jax.policy.SchedulingPolicy "
                     f"object, got {policy!r}")


def is_prefilling(group: SequenceGroup) -> bool:
    """Whether a running sequence of ``group`` has more than one token to compute (a prompt, or a
    recomputed sequence, not yet all in the cache)."""
    return any(s.num_uncomputed_tokens > 1 for s in group.get_seqs(SequenceStatus.RUNNING))


def take_chosen(queue: deque[SequenceGroup], group: SequenceGroup, hook: str) -> SequenceGroup:
    """Remove ``group`` (the one the policy's ``hook`` chose) from ``queue``; return it. ValueError
    when it is not there: a policy must choose among the requests it was given."""
    for i, g in enumerate(queue):
        if g is group:
            del queue[i]
            return group
    raise ValueError(f"the scheduling policy's {hook} returned request {group.request_id!r}, "
                     "which is not one of the requests it was given")
