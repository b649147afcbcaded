"""Random interleavings of every BlockManager operation, checked after each step, with one layer
group (BlockManager) or several (HybridBlockManager: each group's K/V simulated apart).

The machine plays a tiny scheduler and executor: requests with shared prompt
prefixes over a 3-token alphabet (so prefix hits happen), decode and multi-token
growth, prompts in chunks (with several groups, their windowed groups' blocks
taken chunk by chunk when the manager is given a step budget), speculation
(drafts written, the rejected ones rolled back), forks,
finishes, swap out / in, recompute preemption, pins and cache resets, in small
pools (so eviction and preemption happen). It also simulates the KV contents:
every computed slot holds a value derived from the sequence's tokens up to that
position; copies and swaps move values as the executor would. After every step
it checks, independently of the manager's own bookkeeping, that refcounts match
the block tables and pins, that the pools add up, that every sequence reads back
the K/V of its own tokens (so copy-on-write, swapping and prefix hits are right)
and that no write lands in a shared block.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_jax.memory import NULL_BLOCK, AllocStatus, BlockManager, Device, HybridBlockManager
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 2
NUM_GPU_BLOCKS = 14  # 13 usable
NUM_CPU_BLOCKS = 8
PREFIXES = [(), (0, 1, 2, 0), (1, 1, 1, 1, 2, 2), (0, 1) * 10]  # the last may exceed the pool
tokens_st = st.lists(st.integers(0, 2), max_size=6)
pick_st = st.integers(0, 1000)


def kv_values(token_ids: list[int]) -> list[int]:
    """The simulated K/V of each position: depends on the token and everything before it."""
    values, h = [], 0
    for t in token_ids:
        h = hash((h, t))
        values.append(h)
    return values


class BlockManagerMachine(RuleBasedStateMachine):
    # Each layer group's sliding window: one group (every layer's window, or none), or several groups
    # sharing one pool (full attention beside windows, as Gemma's layers).
    @initialize(caching=st.booleans(), watermark=st.sampled_from([0.0, 0.1]),
                windows=st.sampled_from([(None,), (3,), (4,), (3, None), (None, 4, 4), (None, 3, None)]),
                budget=st.sampled_from([None, 2, 5]))
    def setup(self, caching: bool, watermark: float, windows, budget) -> None:
        self.windows = windows
        # The step budget: the most tokens a step computes of one sequence (with several groups, how far
        # past its computed tokens a windowed group's table covers); None: no limit, whole prompts.
        self.budget = budget if len(windows) > 1 else None
        if len(windows) == 1:
            self.bm = BlockManager(BS, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, watermark, caching, sliding_window=windows[0])
        else:
            self.bm = HybridBlockManager(BS, NUM_GPU_BLOCKS * 2, NUM_CPU_BLOCKS * 2, windows, watermark, caching,
                                         max_num_batched_tokens=self.budget)
        self.groups: list[SequenceGroup] = []
        self.ids = itertools.count()
        self.mem = {Device.GPU: defaultdict(lambda: [None] * BS), Device.CPU: defaultdict(lambda: [None] * BS)}
        self.pins: dict[int, list[int]] = {}  # handle -> expected values of the pinned slots

    # ---- helpers ----------------------------------------------------------------------
    def table(self, seq: Sequence, g: int) -> list[int]:
        return self.bm.get_block_table(seq) if len(self.windows) == 1 else self.bm.get_block_table(seq, g)

    def freed(self, seq: Sequence, g: int) -> int:
        return self.bm.get_num_freed_blocks(seq) if len(self.windows) == 1 else self.bm.get_num_freed_blocks(seq, g)

    def live(self, seq: Sequence, g: int = None) -> list[int]:
        """The blocks the sequence's table(s) hold: all but the entries a window freed."""
        if g is None:
            return [b for g in range(len(self.windows)) for b in self.live(seq, g)]
        return self.table(seq, g)[self.freed(seq, g):]

    def write_slots(self, seqs: list[Sequence], stop: int) -> None:
        """Each group's K/V of tokens num_computed..stop-1 of ``seqs`` (one sequence, or several with the same
        tokens computed together: a request's samples computing their prompt), into blocks no other table
        holds: a block shared among ``seqs`` is written once for them all."""
        values = kv_values(seqs[0].get_token_ids())
        for g in range(len(self.windows)):
            for pos in range(seqs[0].num_computed_tokens, stop):
                blocks = [self.table(seq, g)[pos // BS] for seq in seqs]
                for block in set(blocks):
                    assert self.bm.gpu_allocator.get_ref_count(block) == blocks.count(block), \
                        f"write into shared block {block}"
                    self.mem[Device.GPU][block][pos % BS] = (g, values[pos])

    def chunk_end(self, seq: Sequence, chunk: int) -> int:
        """Where a step computing up to ``chunk`` tokens of ``seq`` stops, within the step budget."""
        return min(seq.get_len(), seq.num_computed_tokens + min(chunk, self.budget or chunk))

    def with_status(self, status: SequenceStatus) -> list[SequenceGroup]:
        return [g for g in self.groups if g.seqs[0].status is status]

    def write(self, seqs: list[Sequence], stop: int) -> None:
        """Compute tokens num_computed..stop-1 of ``seqs`` (see ``write_slots``)."""
        self.write_slots(seqs, stop)
        for seq in seqs:
            seq.num_computed_tokens = stop
            self.bm.mark_blocks_computed(seq)

    def preempt(self, group: SequenceGroup) -> None:
        if self.bm.can_swap_out(group):
            self.swap(group, Device.GPU)
        elif len(group.seqs) == 1:
            self.bm.free(group.seqs[0])
            group.seqs[0].reset_for_recompute()
        else:
            self.finish(group, group.seqs)

    def finish(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        for seq in list(seqs):
            self.bm.free(seq)
            seq.status = SequenceStatus.FINISHED_ABORTED
            group.remove(seq.seq_id)
        if not group.seqs:
            self.groups.remove(group)

    def swap(self, group: SequenceGroup, src: Device) -> None:
        status, dst = {Device.GPU: (SequenceStatus.RUNNING, Device.CPU),
                       Device.CPU: (SequenceStatus.SWAPPED, Device.GPU)}[src]
        seqs = group.get_seqs(status)
        before = [self.live(s) for s in seqs]
        mapping = self.bm.swap_out(group) if src is Device.GPU else self.bm.swap_in(group)
        assert set(mapping) == {b for t in before for b in t}  # freed entries move nothing
        assert len(set(mapping.values())) == len(mapping)  # one block per block: sharing survives
        assert [self.live(s) for s in seqs] == [[mapping[b] for b in t] for t in before]
        for old, new in mapping.items():
            self.mem[dst][new] = list(self.mem[src][old])
        for seq in seqs:
            seq.status = SequenceStatus.SWAPPED if src is Device.GPU else SequenceStatus.RUNNING

    # ---- rules -------------------------------------------------------------------------
    @precondition(lambda self: len(self.groups) < 6)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens_st, n=st.integers(1, 3))
    def add_request(self, prefix, suffix, n) -> None:
        prompt = list(prefix) + suffix or [0]
        self.groups.append(SequenceGroup(f"r{len(self.groups)}", [Sequence(next(self.ids), prompt) for _ in range(n)]))

    @precondition(lambda self: self.with_status(SequenceStatus.WAITING))
    @rule(pick=pick_st, chunk=st.integers(1, 8), use_cache=st.booleans())
    def schedule_waiting(self, pick, chunk, use_cache) -> None:
        """Admit a request, with or without prefix lookup. A single sequence computes its
        prompt in chunks (chunked prefill); the n sequences of a sampling request compute
        their shared prompt once."""
        waiting = self.with_status(SequenceStatus.WAITING)
        group = waiting[pick % len(waiting)]
        status = self.bm.can_allocate(group, use_prefix_cache=use_cache)
        if status is AllocStatus.NEVER:
            self.finish(group, group.seqs)
        elif status is AllocStatus.OK:
            plan, free = self.bm.plan_allocation(group, use_cache), self.bm.get_num_free_gpu_blocks()
            self.bm.allocate(group, use_prefix_cache=use_cache)
            assert free - self.bm.get_num_free_gpu_blocks() == plan.num_blocks_taken  # the plan is what it takes
            first = group.seqs[0]
            assert first.num_computed_tokens % BS == 0 and first.num_computed_tokens < first.get_len()
            for seq in group.seqs:
                seq.status = SequenceStatus.RUNNING
            self.check_contents()  # prefix hits must hold this sequence's K/V
            # The n sequences of a sampling request compute their shared prompt together.
            self.write(group.seqs, self.chunk_end(first, chunk if len(group.seqs) == 1 else first.get_len()))

    @precondition(lambda self: self.with_status(SequenceStatus.RUNNING))
    @rule(pick=pick_st, chunk=st.integers(1, 8), data=st.data())
    def step(self, pick, chunk, data) -> None:
        """Sequences with uncomputed tokens compute a chunk of them; the others get
        0-3 new tokens (decode, or several at once). Slots first, else a preemption."""
        running = self.with_status(SequenceStatus.RUNNING)
        group = running[pick % len(running)]
        for seq in group.seqs:
            if seq.num_computed_tokens == seq.get_len():
                for t in data.draw(st.lists(st.integers(0, 2), max_size=3)):
                    seq.append_token_id(t)
        if not self.bm.can_append_slots(group):
            self.preempt(group)
            return
        for seq in group.seqs:
            self.grow(seq)
        together = defaultdict(list)  # sequences with the same tokens computed so far compute them together
        for seq in group.seqs:
            together[tuple(seq.get_token_ids()), seq.num_computed_tokens].append(seq)
        for seqs in together.values():
            self.write(seqs, self.chunk_end(seqs[0], chunk))

    @precondition(lambda self: self.with_status(SequenceStatus.RUNNING))
    @rule(pick=pick_st, proposals=st.lists(st.integers(0, 2), min_size=1, max_size=5), data=st.data())
    def speculate(self, pick, proposals, data) -> None:
        """Speculative decoding: a decoding sequence (its last token not computed yet) runs that token
        plus draft tokens, all written to the cache; then the drafts past the accepted ones are
        removed and its table rolled back (what LLMEngine.step does with a SpecDecoder)."""
        running = self.with_status(SequenceStatus.RUNNING)
        group = running[pick % len(running)]
        seq = group.seqs[pick % len(group.seqs)]
        if seq.num_computed_tokens == seq.get_len():  # sampled after its last step: one token pending
            seq.append_token_id(data.draw(st.integers(0, 2)))
        if seq.num_computed_tokens != seq.get_len() - 1 or not seq.get_output_len():  # still prefilling
            return
        if not self.bm.can_append_slots(group):  # the scheduler's slot for the pending token first
            return
        for s in group.seqs:
            self.grow(s)
        real_len = seq.get_len()
        for t in proposals[:self.budget - 1 if self.budget else None]:  # the pending token and drafts: in budget
            seq.append_token_id(t)
        if not self.bm.can_append_slots(group):  # no room for the drafts: no speculation
            del seq.output_token_ids[real_len - seq.get_prompt_len():]
            return
        self.grow(seq)
        self.write_slots([seq], seq.get_len())  # the step writes every query token
        accepted = data.draw(st.integers(0, len(proposals)))
        del seq.output_token_ids[real_len + accepted - seq.get_prompt_len():]
        seq.num_computed_tokens = seq.get_len()
        self.bm.rollback(seq)
        for g in range(len(self.windows)):
            assert len(self.table(seq, g)) == -(-seq.get_len() // BS)
        self.bm.mark_blocks_computed(seq)
        seq.append_token_id(data.draw(st.integers(0, 2)))  # the target's own next token, not computed

    def grow(self, seq: Sequence) -> None:
        """append_slots, carrying out the copy-on-write copies (one per group at most) as the executor would."""
        last = [self.table(seq, g)[-1] for g in range(len(self.windows))]
        copies = self.bm.append_slots(seq)
        assert len({last.index(src) for src, _ in copies}) == len(copies)  # a group's last block, once each
        for src, dst in copies:
            assert self.bm.gpu_allocator.get_ref_count(dst) == 1
            self.mem[Device.GPU][dst] = list(self.mem[Device.GPU][src])

    @precondition(lambda self: self.with_status(SequenceStatus.RUNNING))
    @rule(pick=pick_st)
    def fork(self, pick) -> None:
        running = self.with_status(SequenceStatus.RUNNING)
        group = running[pick % len(running)]
        parent = group.seqs[pick % len(group.seqs)]
        if len(group.seqs) < 4 and parent.num_computed_tokens == parent.get_len():  # forks follow sampling
            child = parent.fork(next(self.ids))
            self.bm.fork(parent, child)
            group.add(child)

    @precondition(lambda self: self.groups)
    @rule(pick=pick_st)
    def finish_seq(self, pick) -> None:
        group = self.groups[pick % len(self.groups)]
        self.finish(group, [group.seqs[pick % len(group.seqs)]])

    @precondition(lambda self: self.with_status(SequenceStatus.RUNNING))
    @rule(pick=pick_st)
    def swap_out(self, pick) -> None:
        running = self.with_status(SequenceStatus.RUNNING)
        self.preempt(running[pick % len(running)])

    @precondition(lambda self: self.with_status(SequenceStatus.SWAPPED))
    @rule(pick=pick_st)
    def swap_in(self, pick) -> None:
        swapped = self.with_status(SequenceStatus.SWAPPED)
        group = swapped[pick % len(swapped)]
        if self.bm.can_swap_in(group):
            self.swap(group, Device.CPU)

    @precondition(lambda self: len(self.pins) < 3 and self.with_status(SequenceStatus.RUNNING))
    @rule(pick=pick_st)
    def pin(self, pick) -> None:
        running = self.with_status(SequenceStatus.RUNNING)
        seq = running[pick % len(running)].seqs[0]
        if any(self.freed(seq, g) for g in range(len(self.windows))):  # refused: its prefix is no longer held
            return
        handle = self.bm.pin_prefix(seq)
        values, num_groups = kv_values(seq.get_token_ids()), len(self.windows)
        per_group = len(self.bm.get_pinned_blocks(handle)) // num_groups  # pinned group after group
        self.pins[handle] = [(g, v) for g in range(num_groups) for v in values[:per_group * BS]]

    @precondition(lambda self: self.pins)
    @rule(pick=pick_st)
    def unpin(self, pick) -> None:
        handle = sorted(self.pins)[pick % len(self.pins)]
        self.bm.unpin_prefix(handle)
        del self.pins[handle]

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    # ---- invariants ----------------------------------------------------------------------
    def live_tables(self) -> list[tuple[Sequence, Device, list[int]]]:
        out = []
        for group in self.groups:
            for seq in group.seqs:
                if seq.status is SequenceStatus.WAITING:
                    assert not self.bm.has_seq(seq)
                else:
                    device = Device.GPU if seq.status is SequenceStatus.RUNNING else Device.CPU
                    out.append((seq, device))
        return out

    @invariant()
    def refcounts_match_tables_and_pins(self) -> None:
        self.bm.check_invariants()
        expected = {Device.GPU: Counter(), Device.CPU: Counter()}
        for seq, device in self.live_tables():
            expected[device].update(self.live(seq))
            for g, window in enumerate(self.windows):
                table, freed = self.table(seq, g), self.freed(seq, g)
                assert len(table) <= -(-seq.get_len() // BS)  # waste under one block
                if self.budget and window is not None:  # a prompt's blocks chunk by chunk: none past the step's
                    assert len(table) <= -(-min(seq.get_len(), seq.num_computed_tokens + self.budget) // BS)
                    # The window's blocks and a chunk's. A prefix hit's blocks that the window has already
                    # passed stay in the table from admission until the sequence's next growth frees them.
                    first_query = min(seq.num_computed_tokens, seq.get_len() - 1)
                    passed = max(freed, max(0, first_query - window + 1) // BS)
                    assert len(table) - passed <= -(-(window + self.budget + BS - 1) // BS)
                if device is Device.GPU:
                    assert table[:freed] == [NULL_BLOCK] * freed
                # Only blocks no token still to compute can see are freed.
                assert freed == 0 or freed * BS <= seq.num_computed_tokens - window + 1
        for handle in self.pins:
            expected[Device.GPU].update(self.bm.get_pinned_blocks(handle))
        for device, allocator in ((Device.GPU, self.bm.gpu_allocator), (Device.CPU, self.bm.cpu_allocator)):
            assert NULL_BLOCK not in expected[device] or device is Device.CPU
            for block in range(allocator.first_block, allocator.num_blocks):
                assert allocator.get_ref_count(block) == expected[device][block], (device, block)
                assert not (expected[device][block] and allocator.is_free(block))
        usage = self.bm.get_usage()
        gpu, cpu = self.bm.gpu_allocator, self.bm.cpu_allocator
        assert gpu.num_free_blocks + usage.num_used_gpu_blocks + usage.num_cached_gpu_blocks == gpu.num_total_blocks
        assert self.bm.get_num_free_gpu_blocks() == gpu.num_free_blocks + usage.num_cached_gpu_blocks
        assert cpu.num_free_blocks + cpu.num_used_blocks == cpu.num_total_blocks
        assert usage.num_tokens_stored <= usage.num_token_slots_used

    @invariant()
    def check_contents(self) -> None:
        for seq, device in self.live_tables():
            values = kv_values(seq.get_token_ids())
            for g in range(len(self.windows)):
                table = self.table(seq, g)
                for pos in range(self.freed(seq, g) * BS, seq.num_computed_tokens):
                    assert self.mem[device][table[pos // BS]][pos % BS] == (g, values[pos]), (seq.seq_id, g, pos)
        for handle, values in self.pins.items():
            for pos, value in enumerate(values):
                assert self.mem[Device.GPU][self.bm.get_pinned_blocks(handle)[pos // BS]][pos % BS] == value

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for group in list(self.groups):
            self.finish(group, group.seqs)
        for handle in list(self.pins):
            self.bm.unpin_prefix(handle)
        self.bm.check_invariants()
        assert self.bm.gpu_allocator.num_used_blocks == 0 and self.bm.cpu_allocator.num_used_blocks == 0
        assert self.bm.get_num_free_gpu_blocks() == self.bm.gpu_allocator.num_total_blocks
        assert self.bm.get_num_free_cpu_blocks() == self.bm.cpu_allocator.num_total_blocks
        self.bm.reset_prefix_cache()
        assert self.bm.gpu_allocator.num_free_blocks == self.bm.gpu_allocator.num_total_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase
