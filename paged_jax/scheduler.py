"""Iteration-level (continuous) batching, first come first served, with preemption.

Each call to :meth:`Scheduler.schedule` decides one iteration: which sequences
run and how many of their tokens, which blocks move between device and host,
and which blocks are copied. Running requests go first (oldest first); when
their next tokens need blocks that are not there, the newest running requests
are preempted (recompute: drop their blocks and rerun them later; swap: move
their blocks to host memory). Swapped requests come back before any new prompt
is admitted. With chunked prefill, prompts are split so that one iteration
never runs more than ``max_num_batched_tokens`` tokens, and a long prompt shares
iterations with running decodes instead of stalling them.

Plain Python: the same scheduler drives the real engine and the simulator.

Two options turn it into the paper's baselines (Sec. 6.1), for the simulator's
experiments: ``kv_reservation`` reserves each request's KV space at admission
(Orca: ``"max"`` the maximum length, ``"pow2"`` the prompt plus the next power of
two of the true output length, ``"oracle"`` the prompt plus the true output
length, taken from ``max_tokens``), with ``buddy_allocator`` rounding each
reservation up to a power of two as a buddy allocator does; ``static_batching``
admits a new batch only once every request of the last one has finished
(FasterTransformer).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from paged_jax.memory.block_manager import AllocStatus, BlockManager
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_jax.utils import pow2_bucket

logger = logging.getLogger("paged_jax")


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


RESERVATIONS = (None, "max", "pow2", "oracle")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: Optional[str] = None  # None: recompute single-sequence groups, swap the others
    enable_chunked_prefill: bool = False
    kv_reservation: Optional[str] = None  # None (paged, on demand) | "max" | "pow2" | "oracle"
    buddy_allocator: bool = False  # round reservations up to a power of two
    static_batching: bool = False  # admit only when nothing runs (FasterTransformer)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be None, 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.kv_reservation not in RESERVATIONS:
            raise ValueError(f"kv_reservation must be one of {RESERVATIONS}, got {self.kv_reservation!r}")
        if self.buddy_allocator and self.kv_reservation is None:
            raise ValueError("buddy_allocator=True needs a kv_reservation ('max', 'pow2' or 'oracle')")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) without chunked prefill, or a long prompt could never run; "
                "raise it or set enable_chunked_prefill=True")


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
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
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

    # ---- the iteration -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill

        # 1. Running requests, oldest first; preempt the newest when blocks run out.
        running = deque(self.running)
        self.running = []
        num_seqs = 0
        while running:
            group = running.popleft()
            while not self.block_manager.can_append_slots(group):
                victim = running.pop() if running else group
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                # With no token budget left, the group stays running and runs next time.
                budget -= self._schedule_rows(group, budget, out)
                num_seqs += group.num_seqs(SequenceStatus.RUNNING)
                self.running.append(group)

        # 2. Swapped requests come back (oldest first) when nothing was preempted this step.
        if not out.preempted:
            while self.swapped:
                group = self.swapped[0]
                n_seqs = group.num_seqs(SequenceStatus.SWAPPED)
                if num_seqs + n_seqs > self.config.max_num_seqs or budget < n_seqs:
                    break
                if not self.block_manager.can_swap_in(group):
                    if not self.running and not out.scheduled:
                        # Nothing else holds device blocks: it will never fit again.
                        self.swapped.popleft()
                        self._finish_early(group, SequenceStatus.FINISHED_LENGTH_CAPPED,
                                           "its sequences outgrew the KV cache", out)
                        continue
                    break
                self.swapped.popleft()
                out.blocks_to_swap_in.extend(self.block_manager.swap_in(group).items())
                for seq in group.get_seqs(SequenceStatus.SWAPPED):
                    seq.status = SequenceStatus.RUNNING
                budget -= self._schedule_rows(group, budget, out)
                num_seqs += n_seqs
                self.running.append(group)

        # 3. New prompts, first come first served, only when no request is swapped out
        #    (and, with static batching, only when the last batch is done).
        batch_open = not (self.config.static_batching and self.running)
        while batch_open and self.waiting and not self.swapped and not out.preempted:
            group = self.waiting[0]
            seq = group.get_seqs(SequenceStatus.WAITING)[0]
            reason = self._reject_reason(group, seq)
            if reason is not None:
                self.waiting.popleft()
                self._finish_early(group, SequenceStatus.FINISHED_IGNORED, reason, out)
                continue
            # A request's samples fork after its prompt: count them all now.
            n_seqs = max(group.num_seqs(SequenceStatus.WAITING), self._num_samples(group))
            if num_seqs + n_seqs > self.config.max_num_seqs:
                break
            reserve = self.reservation(group)[1]
            status = self.block_manager.can_allocate(group, reserve)
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                self._finish_early(group, SequenceStatus.FINISHED_IGNORED,
                                   f"prompt of {seq.get_len()} tokens can never fit in the KV cache "
                                   f"({self.block_manager.gpu_allocator.num_total_blocks} blocks of "
                                   f"{self.block_manager.block_size} tokens)", out)
                continue
            if status is AllocStatus.LATER:
                if not self.running and not self.swapped and not out.scheduled:
                    # Nothing can free blocks (the rest are pinned prefixes): it would wait forever.
                    self.waiting.popleft()
                    self._finish_early(group, SequenceStatus.FINISHED_IGNORED,
                                       f"prompt of {seq.get_len()} tokens does not fit in the KV cache "
                                       "left free by pinned prefixes", out)
                    continue
                break
            # Without chunking the whole prompt must fit this step's token budget (an upper
            # bound: a prefix-cache hit, found only at allocation, runs fewer tokens).
            if not chunked and self._prefill_tokens(group, seq) > budget and out.scheduled:
                break
            if chunked and budget <= 0:
                break
            self.waiting.popleft()
            params = group.sampling_params
            self.block_manager.allocate(group, use_prefix_cache=getattr(params, "prompt_logprobs", None) is None,
                                        reserve_tokens=reserve)
            for s in group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
            budget -= self._schedule_rows(group, budget, out)
            num_seqs += n_seqs
            self.running.append(group)
        return out

    # ---- helpers -------------------------------------------------------------
    def _schedule_rows(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int:
        """Schedule the running sequences of ``group`` within ``budget`` tokens; return the tokens used.

        Each sequence runs its uncomputed tokens (one for a decode; a prompt, or
        with chunked prefill as much of it as the budget allows). Its block table
        first grows to cover them, copying a shared last block (copy-on-write).
        """
        used = 0
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if group.beam is not None and len(seqs) > 1 and sum(s.num_uncomputed_tokens for s in seqs) > budget:
            return 0  # beams advance together: all of them this step or none
        for seq in seqs:
            need = seq.num_uncomputed_tokens
            n = min(need, budget - used) if self.config.enable_chunked_prefill else need
            if n <= 0 or n > budget - used:
                break
            cow = self.block_manager.append_slot(seq)
            if cow is not None:
                out.blocks_to_copy.append(cow)
            out.scheduled.append(ScheduledSeq(seq, group, n, self.block_manager.get_block_table(seq)))
            used += n
        return used

    def reservation(self, group: SequenceGroup) -> tuple[int, int]:
        """KV tokens the request reserves at admission under ``kv_reservation``: (asked
        for by the policy, allocated after buddy rounding); (0, 0) when paged."""
        policy = self.config.kv_reservation
        if policy is None:
            return 0, 0
        max_len = self.config.max_model_len
        seq = group.seqs[0]
        out_len = getattr(group.sampling_params, "max_tokens", None)
        if policy == "max" or out_len is None:
            asked = max_len
        else:
            asked = min(max_len, seq.get_prompt_len() + (pow2_bucket(out_len) if policy == "pow2" else out_len))
        asked = max(asked, seq.get_len())
        return asked, (pow2_bucket(asked) if self.config.buddy_allocator else asked)

    @staticmethod
    def _prefill_tokens(group: SequenceGroup, seq: Sequence) -> int:
        """Tokens a waiting group must run in its first step (all of a recomputed beam group's beams)."""
        if group.beam is None:
            return seq.get_len()
        return sum(s.get_len() for s in group.get_seqs(SequenceStatus.WAITING))

    @staticmethod
    def _num_samples(group: SequenceGroup) -> int:
        return getattr(group.sampling_params, "best_of", None) or 1

    def _reject_reason(self, group: SequenceGroup, seq: Sequence) -> Optional[str]:
        if seq.get_len() > self.config.max_model_len:
            return f"prompt of {seq.get_len()} tokens exceeds max_model_len={self.config.max_model_len}"
        if self._num_samples(group) > self.config.max_num_seqs:
            return f"best_of={self._num_samples(group)} exceeds max_num_seqs={self.config.max_num_seqs}"
        return None

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
