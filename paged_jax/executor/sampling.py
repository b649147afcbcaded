"""A step's samples from the model step's outputs: the greedy tokens the step computed itself, or
the sampler over its logits.

The jitted model step returns, beside the logits of each row's last token, each row's argmax and
its logprob (:func:`paged_jax.sampler.greedy_tokens`; not for steps with many rows times a large
vocabulary, see ``model_runner.GREEDY_IN_STEP_MAX_LOGITS``). When every sample a batch asks for is that
argmax and nothing more (:func:`paged_jax.sampling_tensors.argmax_only`: greedy, no penalties, no
banned ids, no grammar mask, no top logprobs, no draft tokens, no prompt logprobs), those arrays are
the samples: the step is the step's one dispatch and its ``[rows]`` ids and logprobs its one read.
Any other batch (a single sampled row among greedy ones is enough) takes the general path: the
sampler's own jitted call over the logits (:func:`paged_jax.sampler.sample`), queued behind the step.
Both give the same tokens and logprobs: the same function of the same logits.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.executor.batch import Batch, bucket
from paged_jax.executor.interface import RowSampling, Sample, StepResult, position_histories
from paged_jax.outputs import make_logprobs_dict
from paged_jax.sampler import SamplingTensors, processed_probs, sample, seed_for_sample, token_logprobs
from paged_jax.sampling_tensors import argmax_only
from paged_jax.scheduler import SchedulerOutput
from paged_jax.utils import pow2_bucket


@jax.jit
def _take_rows(x, idx):
    return x[idx]


def batch_is_argmax_only(out: SchedulerOutput, sampling: Sequence[RowSampling], part: list[tuple],
                         all_logits: bool, eos_token_id: Optional[int]) -> bool:
    """Whether every sample the batch's rows ``part`` ask for (``(scheduled row, first scored position
    or None)`` each) is the plain argmax its step returns: no drafts, no logits of every token, and
    every sampling row :func:`argmax_only`."""
    if all_logits:
        return False
    for i, first in part:
        spec = sampling[i]
        if not spec.num_samples:
            continue
        if first is not None or spec.num_candidates or spec.return_probs or not argmax_only(
                spec.params, out.scheduled[i].seq.get_output_len(), eos_token_id):
            return False
    return True


class StepSampler:
    """The runner's sampling: queues a batch's samples behind its step and collects them.
    ``call(name, fn, *args)`` runs one of the module-level jits (the runner's, through its
    executable cache)."""

    def __init__(self, vocab_size: int, seed: int, call: Callable):
        self.vocab_size, self.seed, self._call = vocab_size, seed, call
        self._step = 0  # the unseeded rows' key counter, one per sampler call

    @staticmethod
    def num_compilations() -> int:
        """The sampler's variants and row selections compiled in this process (without the executable cache)."""
        return sample._cache_size() + _take_rows._cache_size()

    def warm_up(self, max_rows: int, prefill_rows: Sequence[int], sampling_params=None,
                eos_token_id: Optional[int] = None, return_probs: bool = False) -> None:
        """Compile the sampler for every row bucket up to ``max_rows`` with ``sampling_params`` (one or
        a list; default greedy), and the row selection out of each step with ``prefill_rows`` logits rows.
        ``return_probs``: the sampled params' processed distributions too (``RowSampling.return_probs``)."""
        from paged_jax.sampling_params import SamplingParams

        plist = [sampling_params or SamplingParams(temperature=0)]
        if isinstance(sampling_params, (list, tuple)):
            plist = list(sampling_params)
        n = 1
        while n <= bucket(max_rows):  # it runs: a [rows, vocab] argmax is cheap
            logits = jnp.zeros((n, self.vocab_size), jnp.float32)
            for p in plist:
                seed = None if p.seed is None else seed_for_sample(p.seed, 0)
                tensors = SamplingTensors.from_params([(p, seed, [0], [])] * n, self.vocab_size, pad_to=n,
                                                      eos_token_id=eos_token_id, engine_seed=self.seed, step=0,
                                                      num_top=pow2_bucket(p.logprobs) if p.logprobs else 0)
                jax.block_until_ready(self._call("sample", sample, logits, tensors))
                if return_probs and not tensors.all_greedy:
                    jax.block_until_ready(self._call("processed_probs", processed_probs, logits, tensors))
            n *= 2
        # A step with prefill tokens has as many logits rows as tokens (one per possible sequence):
        # its sampled rows are taken out of them (``_take_rows``), for every bucket of rows sampled.
        for rows in sorted(set(prefill_rows)):
            logits = jnp.zeros((rows, self.vocab_size), jnp.float32)
            n = 1
            while n <= min(rows, bucket(max_rows)):
                jax.block_until_ready(self._call("take_rows", _take_rows, logits, np.zeros(n, np.int32)))
                n *= 2

    def dispatch(self, out: SchedulerOutput, sampling: Sequence[RowSampling], part: list[tuple], step_out,
                 batch: Batch, all_logits: bool, eos_token_id: Optional[int], drafts_as_rows: bool):
        """Queue what the batch's rows ``part`` (see :func:`batch_is_argmax_only`) ask of the step's
        outputs ``step_out`` (logits, greedy ids, greedy logprobs; possibly not computed yet): nothing
        when the step's own argmax answers all of it, else the sampler. ``drafts_as_rows``: whether a
        row with drafts ran as a decode row per token or as one query tile (the runner's). Returns what :meth:`collect`
        reads: the scheduled row of each sample and the arrays holding them on the device; None when
        no row samples."""
        if step_out.greedy_ids is not None and batch_is_argmax_only(out, sampling, part, all_logits, eos_token_id):
            picks = [i for b, (i, _) in enumerate(part) for _ in sampling[i].seeds]
            rows = [b for b, (i, _) in enumerate(part) for _ in sampling[i].seeds]
            return (picks, rows, (step_out.greedy_ids, step_out.greedy_logprobs)) if picks else None
        return self._dispatch_sampler(out, sampling, part, step_out.logits, batch, all_logits, eos_token_id,
                                      drafts_as_rows)

    def _dispatch_sampler(self, out: SchedulerOutput, sampling: Sequence[RowSampling], part: list[tuple], logits,
                          batch: Batch, all_logits: bool, eos_token_id: Optional[int], drafts_as_rows: bool):
        row_of_logits = batch.last_token if all_logits else np.arange(len(batch.last_token))
        # One sampler row per sample asked for: its scheduled row, and its batch row's logits.
        picks, rows, logit_rows = [], [], []
        num_top = 0
        for b, (i, first) in enumerate(part):
            spec, seq = sampling[i], out.scheduled[i].seq
            if spec.num_samples:
                num_top = max(num_top, spec.num_top)
            if first is not None:  # drafts: one draw at each scored position (paged_jax.spec_decode)
                k = spec.num_speculative_tokens
                histories = position_histories(seq.output_token_ids, k)
                # This batch row scores positions first..last: one token (a decode row), or all k + 1 (a tile).
                last = first if drafts_as_rows else k
                for j in range(first, last + 1):
                    picks.append(i)
                    logit_rows.append(row_of_logits[b] - last + j)
                    rows.append((spec.params, spec.seeds[0], seq.prompt_token_ids, histories[j]))
                continue
            for seed in spec.seeds:
                picks.append(i)
                logit_rows.append(row_of_logits[b])
                rows.append((spec.params, seed, seq.prompt_token_ids, seq.output_token_ids))
        if not rows:
            return None
        n = bucket(len(rows))
        idx = np.zeros(n, np.int32)
        idx[: len(rows)] = logit_rows
        tensors = SamplingTensors.from_params(rows, self.vocab_size, pad_to=n, eos_token_id=eos_token_id,
                                              engine_seed=self.seed, step=self._step,
                                              num_top=pow2_bucket(num_top) if num_top else 0)
        self._step += 1
        # Every row samples (the usual case): the logits are already in order; padded rows are ignored.
        same = n == logits.shape[0] and np.array_equal(idx[: len(rows)], np.arange(len(rows)))
        rows_logits = logits if same else self._call("take_rows", _take_rows, logits, idx)
        drawn = self._call("sample", sample, rows_logits, tensors)
        if not any(sampling[i].return_probs for i in picks):
            return picks, range(len(picks)), drawn
        return picks, range(len(picks)), drawn, self._call("processed_probs", processed_probs, rows_logits, tensors)

    @staticmethod
    def reads_step_argmax(pending, step_out) -> bool:
        """Whether :meth:`dispatch` answered every sample with the step's own argmax (``pending``, its answer)."""
        return pending is not None and pending[2][0] is step_out.greedy_ids

    @staticmethod
    def collect(sampling: Sequence[RowSampling], pending, result: StepResult) -> None:
        """Wait for the samples queued by :meth:`dispatch` and add them to ``result``."""
        if pending is None:
            return
        picks, rows, outputs, *probs = pending
        # Leaf by leaf: on the CPU jax.device_get's asynchronous copies took 0.1-0.2 ms after a step,
        # np.asarray's zero-copy views 0.01-0.03 ms (at batch 1 a step is 2-3 ms).
        # The top-N arrays are [rows, 0] without logprobs asked for: nothing to copy, no read.
        ids, lps, *top = [np.asarray(x) if x.size else np.zeros(x.shape, x.dtype) for x in outputs]
        probs = np.asarray(jax.device_get(probs[0])) if probs else None
        top_ids, top_lps = top or (None, None)  # the step's own argmax has no top-N
        for r, i in zip(rows, picks):
            spec = sampling[i]
            tops = ((), ()) if top_ids is None else (top_ids[r], top_lps[r])
            entry = None if spec.logprobs is None else make_logprobs_dict(ids[r], lps[r], *tops, spec.logprobs)
            cands = None
            if spec.num_candidates:
                k = spec.num_candidates
                cands = ([int(t) for t in top_ids[r][:k]], [float(v) for v in top_lps[r][:k]])
            dist = probs[r] if probs is not None and spec.return_probs else None
            result.samples.setdefault(i, []).append(Sample(int(ids[r]), float(lps[r]), entry, cands, dist))

    @staticmethod
    def prompt_logprobs(row, want: int, logits, batch: Batch, i: int) -> list[dict[int, float]]:
        """Top-``want`` logprob entries of the prompt tokens that follow the tokens batch row ``i``
        (scheduled row ``row``) ran, from the logits of every token."""
        start = int(batch.last_token[i]) - row.num_tokens + 1
        tokens = row.seq.get_token_ids()
        # Token at position p predicts the token at p + 1; only prompt tokens are scored.
        last = min(row.start_pos + row.num_tokens, row.seq.get_prompt_len() - 1)
        n = last - row.start_pos
        if n <= 0:
            return []
        # Pad to a bucket so that prompt lengths do not each compile their own shape.
        nb = bucket(n)
        targets = np.zeros(nb, np.int32)
        targets[:n] = tokens[row.start_pos + 1: row.start_pos + 1 + n]
        rows = np.minimum(np.arange(nb) + start, logits.shape[0] - 1)
        lp, top_ids, top_lps = jax.device_get(
            token_logprobs(logits[rows], targets, num_top=bucket(want) if want else 0))
        return [make_logprobs_dict(targets[t], lp[t], top_ids[t], top_lps[t], want) for t in range(n)]
