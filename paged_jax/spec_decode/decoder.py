"""Speculative decoding in the engine's step, above the executor border (plain Python, no JAX).

A step with speculation runs like this (``LLMEngine.step``):

1. :meth:`SpecDecoder.propose`, after the scheduler: each decoding row (one pending token) of an
   eligible request gets up to ``k`` draft tokens, appended to its sequence for the step and
   covered by its block table (``append_slot``; copy-on-write as usual), so the row runs its
   pending token plus the drafts as query tokens of the same ragged step.
2. The executor draws the target's token at each of the row's ``k + 1`` positions exactly as plain
   decoding would draw it there: the same sampling parameters, the output so far followed by the
   drafts before that position (penalties, ``min_tokens``), and, for a seeded request, the same key
   (the seed folded with the number of tokens generated before that position).
3. :meth:`SpecDecoder.verify`: the drafts leave the sequence; the accepted ones are the longest
   prefix equal to the target's tokens, and the tokens to append are the target's tokens up to and
   including the first mismatch (or the one after the last draft): ``accepted + 1`` tokens. The
   block table is rolled back to the tokens whose K/V are valid (``BlockManager.rollback``).

Why this is lossless. Greedy: the target's token at each position is its argmax given the tokens
before it, so the output equals plain greedy decoding token for token. Sampled: for a
deterministic draft ``x`` (the n-gram proposer's), the rejection sampler of Leviathan et al. /
Chen et al. accepts ``x`` with probability ``min(1, p(x) / q(x)) = p(x)`` and otherwise samples
from ``p`` with ``x`` removed and renormalised. Drawing ``y ~ p`` and accepting when ``y == x`` is
that rule: ``P(accept) = p(x)``, and given a rejection ``y`` follows ``p(. | y != x)``; the emitted
token follows ``p``. Because ``y`` is drawn with the key plain decoding uses at that position, a
seeded request gives the same tokens with or without speculation. A draft *model* serving a sampled
request draws its drafts from its own distribution ``q``: those rows are verified by the general rule
instead (:mod:`.sampled`), with ``q`` kept from the proposal and the target's ``p`` returned by the
step (``RowSampling.return_probs``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from paged_jax.spec_decode import sampled as sampled_drafts
from paged_jax.spec_decode.config import SpeculativeConfig
from paged_jax.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from paged_jax.executor.interface import RowSampling, Sample
    from paged_jax.memory.block_manager import BlockManager
    from paged_jax.sampling_params import SamplingParams
    from paged_jax.scheduler import ScheduledSeq, SchedulerOutput
    from paged_jax.sequence import Sequence


def num_accepted(drafts: Seq[int], target_tokens: Seq[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    n = 0
    while n < len(drafts) and n < len(target_tokens) and drafts[n] == target_tokens[n]:
        n += 1
    return n


@dataclass
class SpecDecodeStats:
    """Counters with vLLM's meanings (``vllm:spec_decode_num_drafts`` ...)."""

    num_drafts: int = 0  # rows that ran with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Per draft position j: drafts accepted at position j (a row's accepted drafts are a prefix, so
    # entry j counts the rows that kept at least j + 1 drafts)
    num_accepted_tokens_per_pos: list = dataclasses.field(default_factory=list)
    proposal_time: float = 0.0  # seconds spent proposing (and growing block tables for the drafts)

    def record(self, num_drafts: int, accepted: int) -> None:
        """One verified row: ``num_drafts`` draft tokens, the first ``accepted`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for j in range(accepted):
            per_pos[j] += 1

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["acceptance_rate"] = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
        # Tokens a verified row yields per target step: 1 + accepted drafts (vLLM's mean acceptance length).
        d["mean_acceptance_length"] = (1 + self.num_accepted_tokens / self.num_drafts) if self.num_drafts else None
        return d


class SpecDecoder:
    """Proposes draft tokens for a step's decoding rows and verifies the target's tokens."""

    @classmethod
    def build(cls, config, block_manager: "BlockManager", scheduler_config, executor=None,
              eos_token_id: Optional[int] = None) -> Optional["SpecDecoder"]:
        """The engine's decoder for ``config`` (a dict or SpeculativeConfig; None: no speculation); a
        draft model is loaded beside ``executor`` (the target's model runner), drafting with the engine's
        ``eos_token_id`` (banned under ``min_tokens``)."""
        if config is None:
            return None
        config = SpeculativeConfig.from_dict(config)
        draft = None
        if config.method == "draft_model":
            from paged_jax.spec_decode.draft_model import DraftModelProposer

            draft = DraftModelProposer.load(config.model, executor, config.num_speculative_tokens, eos_token_id)
        return cls(config, block_manager, scheduler_config.max_model_len, scheduler_config.max_num_batched_tokens,
                   draft, getattr(executor, "seed", 0))

    def __init__(self, config: SpeculativeConfig, block_manager: "BlockManager", max_model_len: int,
                 max_num_batched_tokens: int, draft=None, seed: int = 0) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max, max_model_len)
        self.draft = draft  # a DraftModelProposer (method "draft_model"), else None
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.sampled: dict[int, sampled_drafts.SampledDrafts] = {}  # this step's sampled drafts, by sequence id
        self.unseeded = np.random.default_rng(seed)  # unseeded requests' verification draws

    # ---- before the step ---------------------------------------------------------------
    def propose(self, out: "SchedulerOutput") -> dict[int, int]:
        """Append drafts to the step's eligible decoding rows (their sequences, block tables and
        ``num_tokens``) within the step's token budget and the free blocks. Returns {row index:
        number of drafts}; rows without drafts are absent."""
        t0 = time.perf_counter()
        off = self.config.disable_by_batch_size
        rows = [] if off is not None and len(out.scheduled) >= off else self._candidates(out)
        room = self.max_num_batched_tokens - out.num_batched_tokens
        drafts: dict[int, int] = {}
        if self.draft is not None:  # the draft model runs every step (its cache follows the target's)
            limits = {}
            for i, most in rows:
                if room > 0:
                    limits[i] = min(most, room)
                    room -= limits[i]
            drafts = self.draft.propose(out, limits, self.block_manager)
            self.sampled = {}
            for i, n in drafts.items():
                row = out.scheduled[i]
                row.num_tokens += n
                row.block_table = self.block_manager.get_block_table(row.seq)
                if i in self.draft.probs:
                    self.sampled[row.seq.seq_id] = sampled_drafts.SampledDrafts(
                        self.draft.probs[i], sampled_drafts.row_seed(row), row.group.sampling_params.logprobs)
        else:
            for i, most in rows:
                if room <= 0:
                    break
                row = out.scheduled[i]
                n = self._grow(row, self.proposer.propose(row.seq.get_token_ids(), min(most, room)), out)
                if n:
                    drafts[i] = n
                    room -= n
        self.stats.proposal_time += time.perf_counter() - t0
        return drafts

    def _candidates(self, out: "SchedulerOutput") -> list[tuple[int, int]]:
        """(row index, the most drafts it may get) for the step's eligible rows: at most k, never past
        ``max_tokens`` (the target's own token comes last) or ``max_model_len``."""
        rows = []
        for i, row in enumerate(out.scheduled):
            if not _eligible(row):
                continue
            seq, p = row.seq, row.group.sampling_params
            most = min(self.config.num_speculative_tokens, self.max_model_len - seq.get_len())
            if p.max_tokens is not None:
                most = min(most, p.max_tokens - seq.get_output_len() - 1)
            if most > 0:
                rows.append((i, most))
        return rows

    def _grow(self, row: "ScheduledSeq", proposal: list[int], out: "SchedulerOutput") -> int:
        """Append the drafts to the row's sequence and table, fewer when the free blocks do not cover
        them all; returns how many were appended."""
        seq, bm = row.seq, self.block_manager
        seq.output_token_ids.extend(proposal)
        while proposal and not bm.can_append_slots(row.group):
            proposal.pop()
            seq.output_token_ids.pop()
        if not proposal:
            return 0
        copy = bm.append_slot(seq)
        if copy is not None:  # the scheduler's append_slot already owns the last block; kept for safety
            out.blocks_to_copy.append(copy)
        row.num_tokens += len(proposal)
        row.block_table = bm.get_block_table(seq)
        return len(proposal)

    def attach(self, sampling: list["RowSampling"], drafts: dict[int, int], out: "SchedulerOutput") -> list["RowSampling"]:
        """The rows' sampling with each drafted row asking for the target's token at every scored
        position, and a row with sampled drafts for the target's distribution there too."""
        sampling = list(sampling)
        for i, n in drafts.items():
            probs = out.scheduled[i].seq.seq_id in self.sampled
            sampling[i] = dataclasses.replace(sampling[i], num_speculative_tokens=n, return_probs=probs)
        return sampling

    # ---- after the step ----------------------------------------------------------------
    def verify(self, seq: "Sequence", num_drafts: int, samples: list["Sample"]) -> list["Sample"]:
        """Remove the row's drafts from ``seq`` and return the target's samples to append (the
        accepted drafts' and the target's own next token). ``seq.num_computed_tokens`` becomes the
        tokens with valid K/V: the sequence's tokens plus the accepted drafts."""
        if len(samples) != num_drafts + 1:
            raise ValueError(f"sequence {seq.seq_id}: {num_drafts} drafts need {num_drafts + 1} target "
                             f"samples, got {len(samples)}")
        drafts = seq.output_token_ids[len(seq.output_token_ids) - num_drafts:]
        del seq.output_token_ids[len(seq.output_token_ids) - num_drafts:]
        sampled = self.sampled.pop(seq.seq_id, None)
        if sampled is not None:  # drawn from the draft's q: the general rejection sampler
            samples = sampled_drafts.verify(drafts, sampled, samples, self.config.num_speculative_tokens,
                                            seq.get_output_len(), self.unseeded)
        accepted = len(samples) - 1 if sampled is not None else num_accepted(drafts, [s.token_id for s in samples])
        seq.num_computed_tokens = seq.get_len() + accepted
        self.stats.record(num_drafts, accepted)
        return samples[:accepted + 1]

    def finish(self, seq: "Sequence") -> None:
        """After the verified samples were appended (fewer when a stop ended the sequence): the
        computed tokens never exceed the sequence's, and its table covers no rejected draft."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.get_len() - 1)
        if self.block_manager.has_seq(seq):
            self.block_manager.rollback(seq, seq.num_computed_tokens)

    def apply(self, seq: "Sequence", num_drafts: int, samples: list["Sample"],
              append: Callable[["Sample"], None]) -> None:
        """A drafted row after the step: :meth:`verify`, then ``append`` (the engine's: the token, its
        logprobs, detokenization and the stop checks) each token to append until the sequence
        finishes (a stop, ``max_tokens``, a failure), then :meth:`finish`."""
        for sample in self.verify(seq, num_drafts, samples):
            append(sample)
            if seq.is_finished():
                break
        self.finish(seq)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The engine's (src, dst) block copies made outside a step (forks without block sharing), in the
        draft model's cache too: it reads the forked sequences through the same block ids."""
        if self.draft is not None:
            self.draft.copy_blocks(copies)

    def warm_up(self, scheduler_config, progress: bool = True, sampling_params=None) -> dict:
        """Compile the draft model's steps (method "draft_model"), its draft loop greedy and with each
        sampled one of ``sampling_params`` (the engine's warm-up's); returns the target runner's warm-up
        arguments for the verification steps."""
        c = scheduler_config
        if self.draft is not None:
            from paged_jax.sampling_params import SamplingParams

            # The draft's own steps draw greedy rows and, in steps with a prompt chunk, sampled rows' first drafts.
            plist = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params]
            plist = [SamplingParams(temperature=0), *(p for p in plist if p is not None)]
            self.draft.runner.warm_up(c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, plist,
                                      self.draft.eos_token_id, progress=progress, return_probs=True)
            off = self.config.disable_by_batch_size  # steps of that many rows never draft
            self.draft.warm_up(c.max_num_seqs if off is None else min(c.max_num_seqs, off - 1), c.max_model_len,
                               sampling_params)
        # A draft model's sampled drafts are verified against the target's processed distributions.
        return {"num_speculative_tokens": self.config.num_speculative_tokens, "return_probs": self.draft is not None}

    @staticmethod
    def check_request(params: "SamplingParams") -> None:
        """Refuse what speculation cannot serve, before it is queued."""
        if params.use_beam_search:
            raise ValueError("use_beam_search=True is not supported with speculative decoding "
                             "(speculative_config); use an engine without it for beam search")

    def get_stats(self) -> dict:
        return {**self.stats.as_dict(), "num_speculative_tokens": self.config.num_speculative_tokens,
                "method": self.config.method}


def _eligible(row: "ScheduledSeq") -> bool:
    """A decoding row (its one pending token completes it) of a request speculation serves: not beam
    search (refused at add_request), not structured output (its grammar would have to take the
    drafts back), and not a request's first token (best_of fans out from it)."""
    seq, group = row.seq, row.group
    return (row.num_tokens == 1 and row.completes and seq.get_output_len() > 0 and group.beam is None
            and seq.matcher is None)
