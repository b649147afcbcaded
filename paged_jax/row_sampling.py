"""What the engine asks the executor to draw for each scheduled row (``RowSampling``, plain data):
the samples, their seeds, logprobs and beam candidates, and structured output's token bitmasks."""

from __future__ import annotations

import dataclasses

from paged_jax.executor.interface import RowSampling
from paged_jax.scheduler import ScheduledSeq
from paged_jax.seeds import seed_for_sample


def row_sampling(row: ScheduledSeq) -> RowSampling:
    """What the executor draws for one scheduled row. A row whose chunk completes its
    sequence samples: ``best_of`` times on a request's first token (the engine's step forks the
    extra samples from the prompt), otherwise once, each sample with its own seed; a beam
    row's sample carries the beam's best candidates. Rows running prompt tokens of a
    request that asks for prompt logprobs get those."""
    seq, group, p = row.seq, row.group, row.group.sampling_params
    seeds = ()
    if row.completes:
        first = seq.get_output_len() == 0 and group.num_seqs() == 1
        k = p.best_of if first and not p.use_beam_search else 1
        sample_indices = range(k) if k > 1 else [seq.sample_index]
        seeds = tuple(None if p.seed is None else seed_for_sample(p.seed, j) for j in sample_indices)
    # More candidates than the search's when more logprobs are asked for: the extra ones
    # rank below this beam's own top candidates and never enter the search.
    cands = max(group.beam.num_candidates, p.logprobs or 0) if group.beam is not None else 0
    prompt = p.prompt_logprobs if row.start_pos < seq.get_prompt_len() else None
    return RowSampling(p, seeds, p.logprobs, cands, prompt)


def attach_bitmasks(grammars, scheduled: list[ScheduledSeq], sampling: list[RowSampling]):
    """Structured output: each constrained row that samples gets its grammar's token bitmask,
    carried by a per-row copy of its params. The masks are computed in one parallel call of
    ``grammars`` (the engine's GrammarCompiler) in a worker thread while the executor dispatches
    the step (the sampler waits for them). Returns the rows' sampling and the pending masks (None
    without a constrained row)."""
    rows = [i for i, row in enumerate(scheduled) if row.seq.matcher is not None and sampling[i].seeds]
    if not rows:
        return sampling, None
    from paged_jax.structured_output.grammar import with_bitmask

    masks = grammars.start_bitmasks([scheduled[i].seq.matcher for i in rows])
    sampling = list(sampling)
    for k, i in enumerate(rows):
        sampling[i] = dataclasses.replace(sampling[i], params=with_bitmask(sampling[i].params, masks.row(k)))
    return sampling, masks
