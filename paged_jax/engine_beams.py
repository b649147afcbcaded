"""Beam search applied to the engine's sequences: one step's decision (:func:`paged_jax.beam_search.beam_step`)
carried out through the block manager and the scheduler. A parent chosen twice is forked (its blocks
shared, the last one copied on write), a parent chosen by nobody is freed before the forks, so its
blocks can serve them; finished hypotheses hold no blocks."""

from __future__ import annotations

from paged_jax.beam_search import beam_step
from paged_jax.outputs import make_logprobs_dict
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus


def apply_beam_step(engine, group: SequenceGroup, rows: list) -> list[tuple[int, int]]:
    """Advance ``group``'s beam search by one token: keep, fork and free beams through the engine's
    block manager and scheduler. ``rows``: (beam, its sample with the beam's candidates) per running
    beam. Returns the device copies the forks need (none with block sharing)."""
    p, state = group.sampling_params, group.beam
    beams = [seq for seq, _ in rows]
    stops = engine._stop_token_ids(p)
    hyps = [s for s in group.seqs if s.beam_score is not None]
    d = beam_step(state, [s.cumulative_logprob for s in beams], [smp.candidates for _, smp in rows],
                  beams[0].get_output_len(), [s.beam_score for s in hyps], lambda t: t in stops)

    def extend(seq: Sequence, c) -> None:
        entry = None
        if p.logprobs is not None:
            ids, lps = next(smp.candidates for s, smp in rows if s is beams[c.parent])
            entry = make_logprobs_dict(c.token_id, c.logprob, ids, lps, p.logprobs)
        seq.append_token_id(c.token_id, c.logprob, entry)
        seq.cumulative_logprob = float(c.score)  # the float32 sum the search ranks by
        engine.num_generated_tokens += 1
        engine._detokenize(seq, p)

    for c, score in d.finished:  # finished hypotheses hold no blocks
        hyp = beams[c.parent].fork(next(engine._seq_counter))
        extend(hyp, c)
        hyp.beam_score = float(score)
        if c.token_id in stops:
            hyp.status = SequenceStatus.FINISHED_STOPPED
            hyp.stop_reason = c.token_id if c.token_id in p.stop_token_ids else None
        else:
            hyp.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        group.add(hyp)
    hyps = sorted((s for s in group.seqs if s.beam_score is not None), key=lambda s: -s.beam_score)
    if not hyps and d.done:  # nothing finished (a vocabulary smaller than the width): keep the beams
        for c in d.running:
            hyp = beams[c.parent].fork(next(engine._seq_counter))
            extend(hyp, c)
            hyp.beam_score = float(c.score)
            hyp.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            group.add(hyp)
        hyps = sorted((s for s in group.seqs if s.beam_score is not None), key=lambda s: -s.beam_score)
    dropped = {s.seq_id for s in hyps[state.width:]}

    # The next beams: a parent chosen once goes on itself, twice or more is forked first;
    # parents nobody chose are freed before that, so their blocks can serve the forks.
    running = [] if d.done else d.running
    taken = {c.parent for c in running}
    for b, parent in enumerate(beams):
        if b not in taken:
            engine.scheduler.free_seq(parent)
            dropped.add(parent.seq_id)
    plan, continued, copies = [], set(), []
    for c in running:
        parent = beams[c.parent]
        if c.parent in continued:
            child = parent.fork(next(engine._seq_counter))
            copies += engine.block_manager.fork(parent, child)
            group.add(child)
            plan.append((child, c))
        else:
            continued.add(c.parent)
            plan.append((parent, c))
    for seq, c in plan:
        extend(seq, c)
    group.seqs = [s for s in group.seqs if s.seq_id not in dropped]
    return copies
