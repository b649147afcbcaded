"""Draft-model speculation: a smaller model with the target's vocabulary proposes the drafts.

The draft model runs through its own :class:`~paged_jax.executor.model_runner.ModelRunner`, with its
own KV cache array of as many blocks as the target's, indexed by the target's block ids: the draft
reads and writes through the SAME block tables, so allocation, copy-on-write, rollback, swapping and
prefix caching need nothing new. Each engine step the draft first runs what the target runs (the
step's chunks and cache operations: its cache stays filled like the target's), and the rows that
speculate get their first draft from that run; then one-token steps of the drafting rows give
the rest, each draft appended to its sequence and covered by its table before the draft model writes
its K/V (the last draft too: when every draft is accepted the next step starts after it).

Drafts are the draft model's greedy tokens: a deterministic proposal, so the engine's verification
(the target's token drawn at each position as plain decoding draws it, a draft accepted while equal)
keeps greedy and seeded outputs equal to plain decoding's and sampled ones distributed as the
target's (see :mod:`.decoder`). Where the draft cache holds something stale (blocks a fork copied
after a step) only the acceptance suffers, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_jax.memory.block_manager import BlockManager
    from paged_jax.scheduler import SchedulerOutput
    from paged_jax.sequence import Sequence


@dataclass
class _DraftRow:
    """A row of a draft-only step (the scheduler's ScheduledSeq starts at the computed tokens; these
    rows run the newest draft, past them)."""

    seq: "Sequence"
    start_pos: int
    block_table: list[int]
    num_tokens: int = 1
    completes: bool = True


class DraftModelProposer:
    """Proposes each speculating row's drafts with the draft model (see the module docstring)."""

    def __init__(self, runner, k: int) -> None:
        self.runner, self.k = runner, k

    @classmethod
    def load(cls, path: str, target_runner, k: int) -> "DraftModelProposer":
        """The draft model of folder ``path`` beside ``target_runner`` (its block count, attention backend,
        dtype); ValueError when its vocabulary differs or the target's cache is split in layer groups."""
        from paged_jax import envs
        from paged_jax.executor.loading import load_for_serving
        from paged_jax.executor.model_runner import ModelRunner

        target = target_runner.config
        if getattr(target_runner, "num_layer_groups", 1) > 1 or target_runner.mesh is not None:
            raise ValueError("speculative_config['model']: a draft model needs a target with one layer group and "
                             "no tensor parallelism")
        native = envs.native_enabled()
        config, params, _ = load_for_serving(path, target.dtype, 1, None, native_kernels=native)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config['model']: the draft model {path!r} has a vocabulary of "
                             f"{config.vocab_size} tokens, the target {target.vocab_size}; they must be the same")
        num_gpu_blocks = target_runner.kv_caches[0][0].shape[0]
        num_cpu_blocks = target_runner.host_pool[0][0].shape[0] if target_runner.host_pool else 0
        runner = ModelRunner(config, params, target_runner.block_size, num_gpu_blocks, num_cpu_blocks,
                             target_runner.attention_backend, target_runner.seed, native_kernels=native)
        return cls(runner, k)

    def propose(self, out: "SchedulerOutput", limits: dict[int, int], block_manager: "BlockManager") -> dict[int, int]:
        """Run ``out`` on the draft model, then draft for the rows ``limits`` names (row index: most
        drafts): each draft is appended to the row's sequence and covered by its table. Returns {row
        index: drafts appended}."""
        from paged_jax.executor.interface import RowSampling
        from paged_jax.sampling_params import SamplingParams

        greedy = SamplingParams(temperature=0)
        # Every completing row draws (only the speculating rows' draws are used): a decode step's logits then
        # go to the sampler whole, the shapes warm-up compiled.
        sampling = [RowSampling(greedy, (None,) if row.completes else ()) for row in out.scheduled]
        result = self.runner.execute(out, sampling)
        tokens = {i: result.samples[i][0].token_id for i in limits}
        counts = dict.fromkeys(limits, 0)
        while tokens:
            rows = []
            for i, token in tokens.items():
                row = out.scheduled[i]
                if counts[i] == limits[i] or not self._append(row.seq, row.group, token, block_manager, out):
                    continue
                counts[i] += 1
                # The draft model runs every draft, the last one too: when all are accepted the next step
                # starts after it, and the draft cache needs its K/V as the target's has it.
                seq = row.seq
                rows.append((i, _DraftRow(seq, seq.get_len() - 1, block_manager.get_block_table(seq))))
            if not rows:
                break
            from paged_jax.scheduler import SchedulerOutput

            step = SchedulerOutput(scheduled=[r for _, r in rows])
            result = self.runner.execute(step, [RowSampling(greedy, (None,))] * len(rows))
            tokens = {i: result.samples[b][0].token_id for b, (i, _) in enumerate(rows)}
        return {i: n for i, n in counts.items() if n}

    @staticmethod
    def _append(seq: "Sequence", group, token: int, block_manager: "BlockManager", out) -> bool:
        """Append a draft to ``seq`` and its table, unless the free blocks do not cover it."""
        seq.output_token_ids.append(token)
        if not block_manager.can_append_slots(group):
            seq.output_token_ids.pop()
            return False
        copy = block_manager.append_slot(seq)
        if copy is not None:  # the scheduler's append_slot already owns the last block; kept for safety
            out.blocks_to_copy.append(copy)
        return True
