"""Iteration-level (continuous) batching with preemption.

Each call to :meth:`Scheduler.schedule` decides one iteration: which sequences
run and how many of their tokens, which blocks move between device and host,
and which blocks are copied. Running requests go first; when their next tokens
need blocks that are not there, running requests are preempted (recompute: drop
their blocks and rerun them later; swap: move their blocks to host memory).
Swapped requests come back before any new prompt is admitted. With chunked
prefill, prompts are split so that one iteration never runs more than
``max_num_batched_tokens`` tokens, and a long prompt shares iterations with
running decodes instead of stalling them. With a latency target
(``target_itl_ms``), prefill chunks are sized each step so that the step's
predicted time stays within it (:mod:`paged_jax.step_budget`).

Which request is admitted next, the order requests are served in (prompts
among themselves too), which one is preempted, and whether a request reserves KV
space at admission are the *policy*'s (:mod:`paged_jax.policy`): first come
first served by default; short prompts first with a latency target; the paper's
baselines (Orca's reservations, FasterTransformer's static batches) beside them.

Plain Python: the same scheduler drives the real engine and the simulator.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from paged_jax.memory.block_manager import AllocStatus, BlockManager
from paged_jax.policy import FCFS, Reservation, SchedulingPolicy, is_prefilling, take_chosen
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_jax.step_budget import StepBudget, check_target_itl_ms  # noqa: F401  (engine_args imports it from here)
from paged_jax.step_cost import StepCostModel

logger = logging.getLogger("paged_jax")


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: Optional[str] = None  # None: recompute single-sequence groups, swap the others
    enable_chunked_prefill: bool = False
    policy: SchedulingPolicy = field(default_factory=FCFS)  # see paged_jax.policy
    target_itl_ms: Optional[float] = None  # None: steps sized by max_num_batched_tokens alone

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be None, 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not isinstance(self.policy, SchedulingPolicy):
            raise ValueError(f"policy must be a paged_jax.policy.SchedulingPolicy (FCFS, Orca, FasterTransformer "
                             f"or a subclass of your own), got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill, or a long prompt could never run; "
                "raise it or set enable_chunked_prefill=True")
        check_target_itl_ms(self.target_itl_ms, self.enable_chunked_prefill)


@dataclass
class ScheduledSeq:
    """One row of the batch: ``num_tokens`` tokens of ``seq`` from ``seq.num_computed_tokens`` on."""

    seq: Sequence
    group: SequenceGroup
    num_tokens: int
    block_table: list[int]

    @property
    def start_pos(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this step every token of the sequence has its K/V: sample the next one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.get_len()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (host, device) and (device, host) pairs: a list, since a device block shared by two groups
    # swapped out in one step goes to two host blocks.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
    ignored: list[SequenceGroup] = field(default_factory=list)  # finished at once (too long, never fits)
    preempted: list[tuple[SequenceGroup, PreemptionMode]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 step_cost: Optional[StepCostModel] = None):
        self.config = config
        self.block_manager = block_manager
        # With a latency target: the model predicting step times (fed by the engine with measured steps).
        self.step_cost = step_cost if step_cost is not None or config.target_itl_ms is None else StepCostModel()
        self.policy = config.policy  # replaceable between steps (the throughput benchmark does)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self._held: deque[SequenceGroup] = deque()  # in schedule(): running prompts the policy orders, not served yet
        self.num_preemptions = {m.value: 0 for m in PreemptionMode}

    # ---- queue management ----------------------------------------------------
    def add_seq_group(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort_seq_group(self, request_id: str) -> Optional[SequenceGroup]:
        """Remove a request wherever it is, free its blocks, mark its sequences aborted."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in list(queue):
                if group.request_id == request_id:
                    queue.remove(group)
                    self._finish(group, SequenceStatus.FINISHED_ABORTED)
                    return group
        return None

    def free_seq(self, seq: Sequence) -> None:
        if self.block_manager.has_seq(seq):
            self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> None:
        self.running = [g for g in self.running if not g.is_finished()]

    def reservation(self, group: SequenceGroup) -> Reservation:
        """KV tokens the policy has ``group`` reserve at admission ((0, 0): none)."""
        return self.policy.reservation(group, self.config.max_model_len)

    # ---- the iteration -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide one iteration: running requests first, then swapped ones, then new ones."""
        out = SchedulerOutput()
        c = self.config
        budget = StepBudget(c.max_num_batched_tokens, c.max_num_seqs, self.block_manager.block_size,
                            None if c.target_itl_ms is None else c.target_itl_ms / 1e3, self.step_cost)
        prompts = self._held = self._schedule_running(budget, out)  # the running prompts are left (chunked prefill)
        order = self.policy.order_prefills(list(prompts), self.waiting) if c.enable_chunked_prefill else None
        while order is None and prompts:  # no order of the policy's: they go before swapped and new ones
            self._serve(prompts.popleft(), prompts, budget, out)
        budget.seqs -= sum(g.num_seqs(SequenceStatus.RUNNING) for g in prompts)  # their rows are kept for them
        # Swapped requests return, then new ones are admitted, only if nothing was preempted; new ones once none is swapped.
        if not out.preempted:
            self._schedule_swapped(budget, out)
        admit = not out.preempted and not self.swapped and self.policy.admission_open(self.running + list(prompts))
        if order is not None:
            self._schedule_prompts(order, prompts, admit, budget, out)
        elif admit:
            self._schedule_waiting(budget, out)
        return out

    def _schedule_running(self, budget: StepBudget, out: SchedulerOutput) -> deque[SequenceGroup]:
        """Serve the running requests in the policy's order (see ``_serve``); with chunked prefill only those
        decoding: return the rest (those still prefilling), not served yet."""
        order = self.policy.order_running(self.running)
        if self.config.enable_chunked_prefill:
            # Decode first: a prompt chunk takes what budget the decodes leave, so a long prompt never holds
            # back a token of a running stream. The policy's order is kept within each kind; victims are
            # still chosen among those not served yet (prefills last).
            order = ([g for g in order if not is_prefilling(g)] + [g for g in order if is_prefilling(g)])
        queue = deque(order)
        self.running = []
        while queue and not (self.config.enable_chunked_prefill and is_prefilling(queue[0])):
            self._serve(queue.popleft(), queue, budget, out)
        return queue

    def _serve(self, group: SequenceGroup, others: deque[SequenceGroup], budget: StepBudget,
                   out: SchedulerOutput) -> None:
        """Serve running ``group``. When its next tokens need blocks that are not free, preempt the
        policy's victims among ``others`` (not served yet), or, when none is left, ``group`` itself."""
        if self._make_room(group, others, out):
            # With no token budget left, the group stays running and runs next time.
            self._run(group, group.num_seqs(SequenceStatus.RUNNING), budget, out)
        else:
            self._preempt(group, out)

    def _make_room(self, group: SequenceGroup, others: deque[SequenceGroup], out: SchedulerOutput) -> bool:
        """Preempt the policy's victims among ``others`` until the next tokens of ``group``
        fit; return whether they do."""
        while not self.block_manager.can_append_slots(group):
            if not others:
                return False
            self._preempt(take_chosen(others, self.policy.choose_victim(others), "choose_victim"), out)
        return True

    def _schedule_swapped(self, budget: StepBudget, out: SchedulerOutput) -> None:
        """Bring swapped requests back, oldest first, while they fit."""
        while self.swapped:
            group = self.swapped[0]
            n_seqs = group.num_seqs(SequenceStatus.SWAPPED)
            if n_seqs > budget.seqs or budget.tokens < n_seqs:
                return
            if not self.block_manager.can_swap_in(group):
                if self.running or out.scheduled or self._held:
                    return
                # Nothing else holds device blocks: it will never fit again.
                self.swapped.popleft()
                self._finish_early(group, SequenceStatus.FINISHED_LENGTH_CAPPED,
                                   "its sequences outgrew the KV cache", out)
                continue
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group).items())
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self._run(group, n_seqs, budget, out)

    def _schedule_waiting(self, budget: StepBudget, out: SchedulerOutput) -> None:
        """Admit new requests in the policy's order until one does not fit now (no request overtakes it)."""
        while self.waiting and self._admit(self.policy.next_waiting(self.waiting), budget, out):
            pass

    def _schedule_prompts(self, order: list[SequenceGroup], prompts: deque[SequenceGroup], admit: bool,
                          budget: StepBudget, out: SchedulerOutput) -> None:
        """Serve the policy's ``order`` (``order_prefills``) of running ``prompts`` and waiting requests:
        each running one as in ``_serve`` (its victims among the running prompts after it), each waiting
        one admitted while ``admit`` holds (not after a preemption, nor after one that did not fit)."""
        running = {id(g) for g in prompts}
        if running - {id(g) for g in order}:
            self.running.extend(prompts)  # still running, not lost
            raise ValueError("the scheduling policy's order_prefills left out a running request")
        for group in order:
            if id(group) not in running:
                admit = admit and not out.preempted and self._admit(group, budget, out)
            elif any(g is group for g in prompts):  # not preempted as an earlier one's victim
                budget.seqs += group.num_seqs(SequenceStatus.RUNNING)  # kept for it, taken again as it is served
                self._serve(take_chosen(prompts, group, "order_prefills"), prompts, budget, out)

    def _admit(self, group: SequenceGroup, budget: StepBudget, out: SchedulerOutput) -> bool:
        """Admit the waiting ``group`` if it fits now, reject it if it never can; False if it waits."""
        seq = group.get_seqs(SequenceStatus.WAITING)[0]
        reason = self._reject_reason(group, seq)
        if reason is not None:
            self._reject(group, reason, out)
            return True
        # A request's samples fork after its prompt: count them all now.
        n_seqs = max(group.num_seqs(SequenceStatus.WAITING), group.sampling_params.best_of)
        if n_seqs > budget.seqs:
            return False
        reserve = self.reservation(group).allocated
        # A request that wants every prompt token's logprobs must compute every prompt token.
        use_prefix_cache = group.sampling_params.prompt_logprobs is None
        status = self.block_manager.can_allocate(group, reserve, use_prefix_cache)
        if status is AllocStatus.NEVER:
            self._reject(group, f"prompt of {seq.get_len()} tokens can never fit in the KV cache "
                                f"({self.block_manager.gpu_allocator.num_total_blocks} blocks of "
                                f"{self.block_manager.block_size} tokens)", out)
            return True
        if status is AllocStatus.LATER:
            if self.running or out.scheduled or self._held:
                return False
            # Nothing can free blocks (the rest are pinned prefixes): it would wait forever.
            self._reject(group, f"prompt of {seq.get_len()} tokens does not fit in the KV cache "
                                "left free by pinned prefixes", out)
            return True
        if not self._prompt_fits(group, seq, budget, out):
            return False
        take_chosen(self.waiting, group, "next_waiting")
        self.block_manager.allocate(group, use_prefix_cache=use_prefix_cache, reserve_tokens=reserve)
        for s in group.get_seqs(SequenceStatus.WAITING):
            s.status = SequenceStatus.RUNNING
        self._run(group, n_seqs, budget, out)
        return True

    # ---- helpers -------------------------------------------------------------
    def _run(self, group: SequenceGroup, n_seqs: int, budget: StepBudget, out: SchedulerOutput) -> None:
        """``group`` (``n_seqs`` sequences, counting samples yet to fork) runs this step."""
        self._schedule_rows(group, budget, out)
        budget.seqs -= n_seqs
        self.running.append(group)

    def _schedule_rows(self, group: SequenceGroup, budget: StepBudget, out: SchedulerOutput) -> None:
        """Schedule the running sequences of ``group`` within ``budget``.

        Each sequence runs its uncomputed tokens (one for a decode; a prompt, or
        with chunked prefill as much of it as the budget allows). Its block table
        first grows to cover them, copying a shared last block (copy-on-write).
        """
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        beams = group.beam is not None and len(seqs) > 1
        if beams and sum(s.num_uncomputed_tokens for s in seqs) > budget.tokens:
            return  # beams advance together: all of them this step or none (whole rows, never cut)
        for seq in seqs:
            n = budget.take(seq.num_uncomputed_tokens, seq.num_computed_tokens,
                            self.config.enable_chunked_prefill and not beams)
            if n == 0:
                break
            out.blocks_to_copy += self.block_manager.append_slots(seq)  # copy-on-write, per layer group
            out.scheduled.append(ScheduledSeq(seq, group, n, self.block_manager.get_block_table(seq)))

    def _prompt_fits(self, group: SequenceGroup, seq: Sequence, budget: StepBudget, out: SchedulerOutput) -> bool:
        """Whether a waiting group's prompt can start this step: with chunked prefill, if
        any of the step's budget is left for it; without, if all of it fits (all of a recomputed beam
        group's beams; an upper bound, as a prefix-cache hit runs fewer tokens) or if
        nothing else runs."""
        if self.config.enable_chunked_prefill:
            return budget.prompt_may_start()
        if group.beam is None:
            num_tokens = seq.get_len()
        else:
            num_tokens = sum(s.get_len() for s in group.get_seqs(SequenceStatus.WAITING))
        return num_tokens <= budget.tokens or not out.scheduled

    def _reject_reason(self, group: SequenceGroup, seq: Sequence) -> Optional[str]:
        best_of = group.sampling_params.best_of
        if seq.get_len() > self.config.max_model_len:
            return f"prompt of {seq.get_len()} tokens exceeds max_model_len={self.config.max_model_len}"
        if best_of > self.config.max_num_seqs:
            return f"best_of={best_of} exceeds max_num_seqs={self.config.max_num_seqs}"
        return None

    def _reject(self, group: SequenceGroup, reason: str, out: SchedulerOutput) -> None:
        """A waiting request that can never run leaves the queue, ignored."""
        take_chosen(self.waiting, group, "next_waiting")
        self._finish_early(group, SequenceStatus.FINISHED_IGNORED, reason, out)

    def _finish(self, group: SequenceGroup, status: SequenceStatus) -> None:
        """End every unfinished sequence of ``group`` with ``status`` and free its blocks."""
        for seq in group.get_unfinished_seqs():
            seq.status = status
            self.free_seq(seq)

    def _finish_early(self, group: SequenceGroup, status: SequenceStatus, reason: str,
                      out: SchedulerOutput) -> None:
        """End a request the engine cannot run (rejected, outgrew the cache, no swap space), saying why."""
        logger.warning("request %s ended early (%s): %s", group.request_id, status.value, reason)
        self._finish(group, status)
        group.finish_message = reason
        out.ignored.append(group)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        mode = self._preemption_mode(group)
        if mode is PreemptionMode.SWAP and not self.block_manager.can_swap_out(group):
            if self._can_recompute(group):
                mode = PreemptionMode.RECOMPUTE
            else:
                self._finish_early(group, SequenceStatus.FINISHED_ABORTED,
                                   "aborted: out of KV cache and host swap space", out)
                return
        self.num_preemptions[mode.value] += 1
        logger.warning("preempting request %s by %s: not enough free KV cache blocks (%d free); "
                       "total preemptions: %d", group.request_id, mode.value,
                       self.block_manager.get_num_free_gpu_blocks(), sum(self.num_preemptions.values()))
        out.preempted.append((group, mode))
        if mode is PreemptionMode.RECOMPUTE:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                self.free_seq(seq)
                seq.reset_for_recompute()
            self.waiting.appendleft(group)
        else:
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(group).items())
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            # Victims go newest first; keep the swapped queue oldest first (FCFS when they return).
            self.swapped = deque(sorted([*self.swapped, group], key=lambda g: g.arrival_time))

    def _preemption_mode(self, group: SequenceGroup) -> PreemptionMode:
        # By default, like vLLM, a single sequence is recomputed and a group of several is swapped
        # (recomputing re-prefills each sample's diverged tokens; only common full blocks are shared).
        mode = self.config.preemption_mode
        if mode == "swap":
            return PreemptionMode.SWAP
        if mode == "recompute" and self._can_recompute(group):
            return PreemptionMode.RECOMPUTE
        if mode is None and group.num_seqs(SequenceStatus.RUNNING) == 1:
            return PreemptionMode.RECOMPUTE
        return PreemptionMode.SWAP

    def _can_recompute(self, group: SequenceGroup) -> bool:
        """Beams must be recomputed in one step (they advance together): their tokens must fit the budget."""
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        return (len(seqs) == 1 or group.beam is None
                or sum(s.get_len() for s in seqs) <= self.config.max_num_batched_tokens)
