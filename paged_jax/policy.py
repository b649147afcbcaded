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

Swapped-out requests come back oldest first (by arrival time) under every policy.

:class:`FCFS` (vLLM's policy) is the default. The paper's baselines (Sec. 6.1),
used by the simulator in ``experiments/``, are policies beside it:
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

from collections.abc import Sequence
from typing import NamedTuple, Optional

from paged_jax.sequence import SequenceGroup
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


# The built-in policies by name, for EngineArgs.scheduling_policy and the command line.
POLICIES = {
    "fcfs": FCFS,
    "orca-max": lambda: Orca("max"),
    "orca-pow2": lambda: Orca("pow2"),
    "orca-oracle": lambda: Orca("oracle"),
    "fastertransformer": FasterTransformer,
}


def make_policy(policy) -> SchedulingPolicy:
    """``policy`` itself when it is a :class:`SchedulingPolicy`, else the built-in one of that name
    (:data:`POLICIES`); ValueError naming the allowed values otherwise."""
    if isinstance(policy, SchedulingPolicy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise ValueError(f"scheduling_policy must be one of {list(POLICIES)} or a paged_jax.policy.SchedulingPolicy "
                     f"object, got {policy!r}")
