"""Draft-model speculation: a smaller model with the target's vocabulary proposes the drafts.

The draft model runs through its own :class:`~paged_jax.executor.model_runner.ModelRunner`, with its
own KV cache array of as many blocks as the target's, indexed by the target's block ids: the draft
reads and writes through the SAME block tables, so allocation, copy-on-write, rollback, swapping and
prefix caching need nothing new. Each engine step the draft first runs what the target runs (the
step's chunks and cache operations: its cache stays filled like the target's), and the rows that
speculate get their first draft from that run; then the draft loop (one jitted call of one-token
steps, :mod:`paged_jax.executor.decode_loop`) gives the rest, each draft's slot appended to its sequence
and covered by its table before the draft model writes its K/V (the last draft too: when every draft
is accepted the next step starts after it). A step of decodes only skips the first run: the loop runs
the pending tokens itself.

A greedy request's drafts are the draft model's greedy tokens: a deterministic proposal, so the
engine's verification (the target's argmax at each position, a draft accepted while equal) keeps
the outputs equal to plain decoding's (see :mod:`.decoder`). A sampled request's drafts are drawn
from the draft's processed distribution ``q`` (in the loop, on the device, at the uniforms a draft drawn
one at a time takes), kept for the rejection sampler (:mod:`.sampled`).
The block copies the engine makes between steps (forks without block sharing) are made in the draft's
cache too (:meth:`DraftModelProposer.copy_blocks`). Were the draft cache to hold something stale, only the
acceptance would suffer, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from paged_jax.spec_decode.sampled import DRAFT, draw, is_sampled, position_rng, row_seed

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

    def __init__(self, runner, k: int, eos_token_id: Optional[int] = None) -> None:
        self.runner, self.k = runner, k
        self.eos_token_id = eos_token_id  # banned with the stop ids under min_tokens, as the target's sampler bans it
        # Drafts after the first (greedy and sampled): k + 1 one-token steps in one jitted call, the draft
        # runner's own decode loops (executor/decode_loop.py).
        self.loops = runner.decode_loops
        self.unseeded = np.random.default_rng(runner.seed)  # unseeded requests' draws
        self.probs: dict[int, np.ndarray] = {}  # the last propose's sampled rows: q of each draft, float32[drafts, V]

    def warm_up(self, max_rows: int, max_model_len: int, sampling_params=None) -> None:
        """Compile the draft loop for every decode step shape of up to ``max_rows`` rows: greedy, and
        drawing with each sampled one of ``sampling_params`` (one or a list, as the engine's warm-up
        takes them; their rows' processing is the loop's static part)."""
        from paged_jax.executor.decode_loop import sampled_draws_for

        r = self.runner
        self.loops.warm_up(self.k + 1, r.param_leaves, r.kv_caches, max_rows, max_model_len,
                           sampled_draws_for(sampling_params, self.k + 1, r.config.vocab_size, keyed=False))

    @classmethod
    def load(cls, path: str, target_runner, k: int, eos_token_id: Optional[int] = None) -> "DraftModelProposer":
        """The draft model of folder ``path`` beside ``target_runner`` (its block count, attention backend,
        dtype), drafting with the engine's ``eos_token_id``; ValueError when its vocabulary differs or the
        target's cache is split in layer groups."""
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
        return cls(runner, k, eos_token_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy blocks ``(src, dst)`` in the draft's cache, as the engine copied them in the target's."""
        from paged_jax.scheduler import SchedulerOutput

        self.runner.execute(SchedulerOutput(blocks_to_copy=list(copies)), [])

    def propose(self, out: "SchedulerOutput", limits: dict[int, int], block_manager: "BlockManager") -> dict[int, int]:
        """Run ``out`` on the draft model, then draft for the rows ``limits`` names (row index: most
        drafts): each draft is appended to the row's sequence and covered by its table. Returns {row
        index: drafts appended}; :attr:`probs` then holds each sampled row's q, one per draft."""
        from paged_jax.executor.interface import RowSampling
        from paged_jax.sampling_params import SamplingParams

        self.probs = {}
        if limits and _decode_only(out):  # the loop runs the step's pending tokens itself
            return self._propose_in_loop(out, limits, None, block_manager)
        greedy = SamplingParams(temperature=0)
        # A sampled request's rows draw with its own processing and return q (``Sample.probs``).
        sampled = {i: RowSampling(out.scheduled[i].group.sampling_params, (row_seed(out.scheduled[i]),), return_probs=True)
                   for i in limits if is_sampled(out.scheduled[i])}
        # Every completing row draws (only the speculating rows' draws are used): a decode step's logits then
        # go to the sampler whole, the shapes warm-up compiled.
        sampling = [sampled.get(i) or RowSampling(greedy, (None,) if row.completes else ())
                    for i, row in enumerate(out.scheduled)]
        result = self.runner.execute(out, sampling, self.eos_token_id)
        first = {i: self._next(out.scheduled[i], result.samples[i][0]) for i in limits}
        return self._propose_in_loop(out, limits, first, block_manager)

    def _propose_in_loop(self, out: "SchedulerOutput", limits: dict[int, int], first: "dict[int, tuple] | None",
                         block_manager: "BlockManager") -> dict[int, int]:
        """The rows' drafts in one call of the draft loop: each row's slots for its drafts first
        (placeholders, as many as the free blocks cover), then the loop writes their K/V (the last
        draft's too) and gives the drafts, a sampled row's drawn from its q (kept in :attr:`probs`).
        ``first``: each row's first draft and its q (None: greedy), from the draft's run of ``out``;
        None: ``out`` is a decode step (``_decode_only``) that the loop runs itself, its every row's
        pending token first (a row without drafts only writes that token's K/V)."""
        from paged_jax.executor.decode_loop import loop_batch

        counts = {}
        for i, most in limits.items():
            row, n = out.scheduled[i], 0
            while n < most and self._append(row.seq, row.group, 0 if first is None else first[i][0], block_manager, out):
                n += 1
            counts[i] = n
        run = list(range(len(out.scheduled))) if first is None else [i for i in counts if counts[i]]
        if not run:
            return {}
        seqs = [out.scheduled[i].seq for i in run]
        n = [counts.get(i, 0) for i in run]
        if first is None:  # the loop starts at the pending token: drafts come out of steps 0 .. n - 1
            tokens, positions, lim = [s.get_token_ids()[-m - 1] for s, m in zip(seqs, n)], [
                s.get_len() - m - 1 for s, m in zip(seqs, n)], [m + 1 for m in n]
            from_loop = n
        else:  # the loop starts at the first draft: the others come out of steps 0 .. n - 2
            tokens, positions, lim = [first[i][0] for i in run], [s.get_len() - m for s, m in zip(seqs, n)], n
            from_loop = [m - 1 for m in n]
        batch, lim = loop_batch(tokens, positions, [block_manager.get_block_table(s) for s in seqs], lim,
                                self.runner.block_size)
        drawing = [b for b, (i, d) in enumerate(zip(run, from_loop)) if d > 0 and is_sampled(out.scheduled[i])]
        draws = self._draws([out.scheduled[i] for i in run], from_loop, drawing, batch.block_tables.shape[0])
        r = self.runner
        loop = self.loops.compiled_loop(self.k + 1, r.param_leaves, r.kv_caches, batch, lim, draws)
        out_tokens, _, qs, r.kv_caches = loop(r.param_leaves, r.kv_caches, batch, lim, draws)
        out_tokens = np.asarray(out_tokens)
        qs = None if qs is None else np.asarray(qs)
        for b, (i, seq, m, d) in enumerate(zip(run, seqs, n, from_loop)):
            if not m:
                continue
            drafts = list(out_tokens[:d, b]) if first is None else [tokens[b], *out_tokens[:d, b]]
            seq.output_token_ids[len(seq.output_token_ids) - m:] = [int(t) for t in drafts]
            if first is not None and first[i][1] is not None:
                self.probs[i] = np.concatenate([first[i][1][None], qs[:d, b]]) if d else first[i][1][None]
            elif b in drawing:
                self.probs[i] = qs[:d, b]
        return {i: m for i, m in counts.items() if m}

    def _draws(self, rows: list, from_loop: list[int], drawing: list[int], num_rows: int):
        """The loop's :class:`~paged_jax.executor.decode_loop.LoopDraws` for batch rows ``rows``, of which
        ``drawing`` sample their ``from_loop`` drafts (the others take the argmax); None when none samples.
        Each draw's uniform is the one :meth:`_next` would take at its position (``position_rng``)."""
        from paged_jax.executor.decode_loop import loop_draws

        if not drawing:
            return None
        uniforms = np.zeros((self.k + 1, len(rows)))
        specs = []
        for b, row in enumerate(rows):
            seq = row.seq
            # The output before the loop's first draft: the tokens before the placeholders still to draw.
            history = seq.output_token_ids[:len(seq.output_token_ids) - from_loop[b]]
            if b not in drawing:
                specs.append((None, None, (), history))
                continue
            seed = row_seed(row)
            for j in range(from_loop[b]):
                uniforms[j, b] = position_rng(seed, len(history) + j, DRAFT, self.unseeded).random()
            specs.append((row.group.sampling_params, seed, row.seq.prompt_token_ids, history))
        return loop_draws(specs, num_rows, self.k + 1, self.runner.config.vocab_size, uniforms,
                          eos_token_id=self.eos_token_id)

    def _next(self, row, sample) -> tuple[int, "np.ndarray | None"]:
        """The row's next draft and the q it was drawn from (None: a greedy row's argmax)."""
        if sample.probs is None:
            return sample.token_id, None
        rng = position_rng(row_seed(row), row.seq.get_output_len(), DRAFT, self.unseeded)
        return draw(sample.probs, rng), sample.probs

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


def draft_kv_bytes_per_token(config, dtype: str) -> int:
    """Bytes a token takes in the KV cache of ``config``'s draft model (a SpeculativeConfig or None) loaded
    in ``dtype`` (the target's): the draft's cache has a block for each of the target's, so every block
    of the pools costs that much more a token. 0 without a draft model."""
    draft = _draft_config(config, dtype)
    return 0 if draft is None else draft.kv_bytes_per_token


def draft_weight_bytes(config, dtype: str) -> int:
    """Bytes of the weights of ``config``'s draft model loaded in ``dtype`` (from its checkpoint's tensor
    shapes, before it is loaded): the pool is sized before the draft loads, and on an accelerator its
    weights come out of ``gpu_memory_utilization``'s share like the target's. 0 without a draft model."""
    draft = _draft_config(config, dtype)
    if draft is None:
        return 0
    from paged_jax.models import FAMILIES
    from paged_jax.models.config import DTYPE_BYTES

    shapes = FAMILIES[draft.family].hf_tensor_shapes(draft).values()
    return int(sum(np.prod(shape, dtype=np.int64) for shape in shapes)) * DTYPE_BYTES[draft.dtype]


def _draft_config(config, dtype: str):
    """The ModelConfig of ``config``'s draft model in ``dtype``, or None without one."""
    if config is None or config.model is None:
        return None
    from paged_jax.errors import ModelLoadError
    from paged_jax.parallel.checkpoint import load_config_any

    try:
        return load_config_any(config.model, dtype)
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config['model']: {e}") from e


def _decode_only(out: "SchedulerOutput") -> bool:
    """Whether ``out`` runs one pending token per row and no cache operation: the draft loop can run it."""
    return (not (out.blocks_to_swap_in or out.blocks_to_swap_out or out.blocks_to_copy)
            and all(row.num_tokens == 1 and row.completes for row in out.scheduled))

