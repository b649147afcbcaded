"""LLMEngine: requests in, RequestOutputs out, one scheduler iteration per ``step()``.

``add_request`` tokenizes a prompt and queues a sequence group; ``step`` asks
the scheduler what runs, has the executor run it, then appends the sampled
tokens, detokenizes incrementally, applies the stop rules and frees finished
sequences' blocks.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Optional, Union

from paged_jax.engine_args import DYNAMIC_ROPE_SHARING, EngineArgs, build_engine_parts
from paged_jax.beam_search import BeamState, num_candidates
from paged_jax.engine_beams import apply_beam_step
from paged_jax.engine_stats import engine_stats
from paged_jax.executor.interface import Executor
from paged_jax.memory.block_manager import BlockManager
from paged_jax.multi_step import MultiStepDecoder, check_multi_step, check_num_scheduler_steps
from paged_jax.outputs import RequestOutput, request_output
from paged_jax.row_sampling import attach_bitmasks, row_sampling
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_jax.spec_decode import SpecDecoder
from paged_jax.step_cost import StepCostModel, StepLoad, calibrate
from paged_jax.text import check_stop, detokenize_incrementally, text_decoder

logger = logging.getLogger("paged_jax")
# How the finish_message of a request ended by per-request fault isolation starts (see _fail_request).
REQUEST_FAILED = "request failed while processing its output"


class LLMEngine:
    def __init__(self, args: EngineArgs):
        """Load the model of ``args`` and build the engine's parts (see :func:`build_engine_parts`)."""
        parts = build_engine_parts(args)
        self.args, self.model_config, self.tokenizer = args, parts.model_config, parts.tokenizer
        self.eos_token_ids, self.eos_token_id = parts.eos_token_ids, parts.eos_token_id
        step_cost = None
        if parts.scheduler_config.target_itl_ms is not None:
            from paged_jax.attention.metadata import TILE_SIZE
            from paged_jax.executor.batch import step_buckets

            # The runner computes a step's tokens padded to its bucket, prefill queries in tiles: the model counts those.
            step_cost = StepCostModel(padded_tokens=lambda tokens, rows: step_buckets(tokens, rows)[0],
                                      query_tile=TILE_SIZE)
        self._init_core(parts.scheduler_config, parts.block_manager, parts.runner, parts.model_config.vocab_size,
                        step_cost=step_cost, speculative_config=args.speculative_config,
                        num_scheduler_steps=args.num_scheduler_steps)

    @classmethod
    def from_components(cls, scheduler_config: SchedulerConfig, block_manager: BlockManager, executor: Executor,
                        vocab_size: int, tokenizer=None, eos_token_id: Optional[int] = None,
                        clock=time.monotonic, step_cost: Optional[StepCostModel] = None,
                        speculative_config=None, num_scheduler_steps: int = 1) -> "LLMEngine":
        """An engine over given parts, without loading a model: ``executor`` implements
        :class:`paged_jax.executor.interface.Executor` (a simulator, a test's fake). With
        no tokenizer, requests are given as token ids and nothing is detokenized (stop
        strings never match). ``clock()`` gives the default arrival time (a simulator
        passes its simulated clock)."""
        engine = cls.__new__(cls)
        engine.args, engine.model_config, engine.tokenizer = None, None, tokenizer
        engine.eos_token_id = eos_token_id
        engine.eos_token_ids = frozenset(() if eos_token_id is None else (eos_token_id,))
        engine._init_core(scheduler_config, block_manager, executor, vocab_size, clock, step_cost,
                          speculative_config, num_scheduler_steps)
        return engine

    def _init_core(self, scheduler_config: SchedulerConfig, block_manager: BlockManager, executor: Executor,
                   vocab_size: int, clock=time.monotonic, step_cost: Optional[StepCostModel] = None,
                   speculative_config=None, num_scheduler_steps: int = 1) -> None:
        self.scheduler_config = scheduler_config
        self.block_manager = block_manager
        self.scheduler = Scheduler(scheduler_config, block_manager, step_cost)
        self.runner = executor
        self.vocab_size = vocab_size
        self.clock = clock
        self._seq_counter = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}
        self._prompt_logprobs: dict[str, list] = {}
        self._prefix_requests: dict[str, Optional[int]] = {}  # add_prefix requests -> pin handle once done
        self.num_generated_tokens = 0
        self.num_steps = 0
        self._pending_outputs: list[RequestOutput] = []
        self.timings = {"schedule": 0.0, "execute": 0.0, "process": 0.0, "detokenize": 0.0}
        self._text_decoder = None if self.tokenizer is None else text_decoder(self.tokenizer)
        self._grammars = None  # structured output's GrammarCompiler, built for the first constrained request
        # None: off; a draft model (speculative_config['model']) is loaded beside the executor
        self.spec_decoder = SpecDecoder.build(speculative_config, block_manager, scheduler_config, executor,
                                              self.eos_token_id)
        # No step run ahead (executor.run_ahead) beside a draft model, nor where a cost model learns from step times.
        draft_or_cost = getattr(self.spec_decoder, "draft", None) or self.scheduler.step_cost
        if draft_or_cost is not None and hasattr(executor, "run_ahead"):
            executor.run_ahead = False
        self.multi_step = None  # num_scheduler_steps > 1: several decode steps per engine step (paged_jax.multi_step)
        check_num_scheduler_steps(num_scheduler_steps, speculative_config, self.scheduler_config.target_itl_ms)
        if num_scheduler_steps > 1:
            check_multi_step(executor)
            self.multi_step = MultiStepDecoder(num_scheduler_steps, block_manager, scheduler_config.max_model_len,
                                               self.eos_token_id)

    def warm_up(self, sampling_params: Union[None, SamplingParams, list[SamplingParams]] = None,
                progress: bool = True) -> int:
        """Compile the step shapes a run can reach before the first request (batch sizes x
        token counts x block-table widths up to max_num_seqs / max_num_batched_tokens /
        max_model_len; see ``paged_jax.executor.batch.warmup_shapes``) and the sampler for
        ``sampling_params`` (default greedy), so that serving compiles nothing. With JAX's
        persistent compilation cache a second start loads them from disk. Returns the number
        of step shapes compiled now. With a latency target it then runs a few short internal
        requests to calibrate the step-cost model (:func:`paged_jax.step_cost.calibrate`)."""
        c = self.scheduler_config
        # With speculative decoding: its draft model's steps, and the verification steps (ModelRunner's argument).
        spec = {} if self.spec_decoder is None else self.spec_decoder.warm_up(c, progress, sampling_params)
        if self.multi_step is not None:  # and the decode loops
            spec["num_scheduler_steps"] = self.multi_step.num_steps
        compiled = self.runner.warm_up(c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, sampling_params,
                                       self.eos_token_id, progress, **spec)
        calibrate(self)  # with a latency target: the step-cost model from a few measured steps (no-op otherwise)
        return compiled

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    # ---- requests ------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Optional[str], sampling_params: SamplingParams,
                    prompt_token_ids: Optional[list[int]] = None, arrival_time: Optional[float] = None) -> None:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if sampling_params.use_beam_search and sampling_params.stop:
            raise ValueError(f"stop strings are not supported with use_beam_search=True (got stop="
                             f"{sampling_params.stop!r}); use stop_token_ids")
        if self.spec_decoder is not None:
            self.spec_decoder.check_request(sampling_params)
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string when prompt_token_ids is not given, got {prompt!r}")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give prompt_token_ids, not a prompt string")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it tokenized to zero tokens)")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids hold ids outside [0, {self.vocab_size}): {bad[:5]}")
        # The sampler packs stop ids into int32 arrays indexed by token: an id outside the
        # vocabulary would fail (or wrap) inside step(), for every request in the batch.
        bad = [t for t in sampling_params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids hold ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        self._check_fits(len(prompt_token_ids), sampling_params.max_tokens)
        matcher = None
        if sampling_params.structured_outputs is not None:  # compiled (or cached) before anything is queued
            matcher = self.grammar_compiler.matcher(sampling_params.structured_outputs)
        seq = Sequence(next(self._seq_counter), prompt_token_ids, matcher=matcher)
        seq.prefix_offset = max(len(prompt_token_ids) - 5, 0)
        seq.read_offset = len(prompt_token_ids)
        group = SequenceGroup(request_id, [seq], sampling_params,
                              self.clock() if arrival_time is None else arrival_time, prompt)
        if sampling_params.use_beam_search:
            group.beam = self._beam_state(sampling_params, len(prompt_token_ids))
        self._groups[request_id] = group
        if sampling_params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = [None]
        self.scheduler.add_seq_group(group)

    @property
    def grammar_compiler(self):
        """Structured output's compiler for this engine's tokenizer (built on first use)."""
        if self._grammars is None:
            from paged_jax.structured_output.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _check_fits(self, prompt_len: int, max_tokens: Optional[int]) -> None:
        """Refuse up front a request whose prompt plus max_tokens can never fit in the KV cache, as
        vLLM does, rather than cut it short later. (A prompt that alone does not fit is ended by the
        scheduler, finish reason "length" with a message; without max_tokens a request may still
        outgrow the cache, and then ends the same way.)"""
        bs, have = self.block_manager.block_size, self.block_manager.gpu_allocator.num_total_blocks
        need = self.block_manager.num_blocks_needed  # every layer group's blocks, at most (one group: ceil(n / bs))
        if max_tokens is None or need(prompt_len, prompt_len + 1) > have:
            return
        total = min(prompt_len + max_tokens, self.scheduler_config.max_model_len)
        if need(prompt_len, total) > have:
            lo, hi = prompt_len + 1, total  # the longest sequence that fits, by bisection
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if need(prompt_len, mid) <= have else (lo, mid)
            raise ValueError(f"max_tokens={max_tokens} can never fit in the KV cache: the prompt ({prompt_len} "
                             f"tokens) and the completion need {need(prompt_len, total)} blocks of {bs} tokens, the "
                             f"cache holds {have}; lower max_tokens to at most {lo - prompt_len}")

    def _stop_token_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

    def _beam_state(self, p: SamplingParams, prompt_len: int) -> BeamState:
        limit = self.scheduler_config.max_model_len - prompt_len
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens)
        return BeamState(width=p.best_of, length_penalty=p.length_penalty, early_stopping=p.early_stopping,
                         max_new_tokens=max(1, limit),
                         num_candidates=num_candidates(p.best_of, len(self._stop_token_ids(p))))

    def add_prefix(self, prompt: Optional[str] = None, prompt_token_ids: Optional[list[int]] = None) -> int:
        """Compute a shared prefix (a system prompt, few-shot examples) once and keep its
        full blocks in the cache (the paper's Sec. 4.4). Later requests whose prompts
        start with it map those blocks instead of recomputing them, with or without
        automatic prefix caching. Runs the engine until the prefix is computed;
        returns a handle for :meth:`release_prefix`."""
        if self.model_config is not None and self.model_config.rope_type == "dynamic":
            raise ValueError(DYNAMIC_ROPE_SHARING)
        rid = f"__prefix_{next(self._seq_counter)}"
        self.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                         prompt_token_ids=prompt_token_ids)
        self._prefix_requests[rid] = None
        group = self._groups[rid]
        while not group.is_finished():
            # Other requests' outputs from these steps are handed out by the next step().
            self._pending_outputs = self.step()  # step() hands back the pending ones it does not supersede
        handle = self._prefix_requests.pop(rid)
        if handle is None:
            raise ValueError(f"prefix could not be computed: {group.finish_message or 'it was not run'}")
        return handle

    def release_prefix(self, handle: int) -> None:
        """Drop a prefix kept by :meth:`add_prefix`; its blocks are freed once no request uses them."""
        self.block_manager.unpin_prefix(handle)

    def abort_request(self, request_id: Union[str, list[str]]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self.scheduler.abort_seq_group(rid) is not None:
                self._groups.pop(rid, None)
                self._prompt_logprobs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending_outputs) or self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # ---- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. Returns the outputs of the requests it touched (finished ones last time)."""
        pending, self._pending_outputs = self._pending_outputs, []
        self._failed: set[str] = set()  # requests whose processing raised this step (see _fail_request)
        t0, start, compilations = time.perf_counter(), self.clock(), self.runner.num_compilations
        out = self.scheduler.schedule()
        drafts = self.spec_decoder.propose(out) if self.spec_decoder is not None else {}  # rows' draft tokens
        self.num_steps += 1
        # With a latency target, the whole step's time (what a stream waits) feeds the step-cost model.
        load = StepLoad.of((r.num_tokens, r.start_pos) for r in out.scheduled) if self.scheduler.step_cost else None
        t1 = time.perf_counter()
        sampling, masks = [row_sampling(row) for row in out.scheduled], None
        if self._grammars is not None:
            sampling, masks = attach_bitmasks(self._grammars, out.scheduled, sampling)
        sampling = self.spec_decoder.attach(sampling, drafts, out) if drafts else sampling
        # Multi-step decoding: each row's tokens of several decode steps in one call (None: one step).
        multi = self.multi_step.plan(out, sampling) if self.multi_step is not None else None
        if multi is not None:
            result = self.runner.execute_steps(out, sampling, multi, self.multi_step.num_steps, self.eos_token_id)
        else:
            result = self.runner.execute(out, sampling, self.eos_token_id)
        if masks is not None:
            masks.result()  # done (the sampler read them); the matchers advance below
        t2 = time.perf_counter()
        self.timings["schedule"] += t1 - t0
        self.timings["execute"] += t2 - t1
        touched: dict[str, SequenceGroup] = {g.request_id: g for g in out.ignored}
        beam_rows: dict[str, list] = {}
        fork_copies: list[tuple[int, int]] = []  # device copies of forked blocks (without block sharing)
        for i, row in enumerate(out.scheduled):
            seq, group = row.seq, row.group
            touched[group.request_id] = group
            if i in result.prompt_logprobs:
                acc = self._prompt_logprobs[group.request_id]
                new = result.prompt_logprobs[i]
                # After a recompute preemption the prompt reruns: keep the first scores only.
                acc.extend(new[max(0, len(acc) - 1 - row.start_pos):])
            seq.num_computed_tokens += row.num_tokens
            samples = result.samples.get(i)
            if multi is not None:  # the row's tokens of every step, appended and stop-checked one by one
                self.multi_step.apply(seq, samples, lambda smp, s=seq, g=group: self._append(s, smp, g))
                continue
            if i in drafts:  # speculative decoding: the accepted drafts and the model's next token, stop-checked
                self.spec_decoder.apply(seq, drafts[i], samples, lambda smp, s=seq, g=group: self._append(s, smp, g))
                continue
            if not samples:
                continue
            if group.beam is not None:
                beam_rows.setdefault(group.request_id, []).append((seq, samples[0]))
                continue
            # The first sample continues ``seq``; extra ones (best_of > 1) fork from the prompt.
            for j, smp in enumerate(samples[1:], start=1):
                child = seq.fork(next(self._seq_counter), sample_index=j)
                fork_copies += self.block_manager.fork(seq, child)
                group.add(child)
                self._append(child, smp, group)
            self._append(seq, samples[0], group)
        for row in out.scheduled:
            if self.block_manager.has_seq(row.seq):
                self.block_manager.mark_blocks_computed(row.seq)
        for rid, rows in beam_rows.items():
            try:
                fork_copies += apply_beam_step(self, touched[rid], rows)
            except Exception as exc:
                self._fail_request(touched[rid], exc)
        for rid in self._failed:  # samples forked after the failure inherit nothing: end them all
            for seq in touched[rid].get_unfinished_seqs():
                seq.status = SequenceStatus.FINISHED_ABORTED
        if fork_copies:  # without block sharing, forked sequences get copies of their parents' blocks
            self.runner.execute(SchedulerOutput(blocks_to_copy=fork_copies), [])
            if self.spec_decoder is not None:
                self.spec_decoder.copy_blocks(fork_copies)  # a draft model's cache too
        for group in touched.values():
            for seq in group.get_seqs():
                if seq.is_finished() and self.block_manager.has_seq(seq):
                    if group.request_id in self._prefix_requests:
                        self._prefix_requests[group.request_id] = self.block_manager.pin_prefix(seq)
                    self.scheduler.free_seq(seq)
        self.scheduler.free_finished_seq_groups()
        outputs = [o for o in pending if o.request_id not in touched]
        for rid, group in touched.items():
            if rid not in self._prefix_requests:  # add_prefix's own requests are internal
                outputs.append(request_output(group, self._prompt_logprobs.get(rid)))
            if group.is_finished():
                self._groups.pop(rid, None)
                self._prompt_logprobs.pop(rid, None)
        self.timings["process"] += time.perf_counter() - t2
        if load is not None and self.runner.num_compilations == compilations:  # a compiling step is no sample
            self.scheduler.step_cost.observe(load, self.clock() - start)
        return outputs

    def _append(self, seq: Sequence, smp, group: SequenceGroup) -> None:
        if group.request_id in self._failed:
            return
        try:
            seq.append_token_id(smp.token_id, smp.logprob, smp.logprobs)
            self.num_generated_tokens += 1
            if seq.matcher is not None:
                seq.matcher.accept(smp.token_id)
            new_text = self._detokenize(seq, group.sampling_params)
            check_stop(seq, group.sampling_params, new_text, self.eos_token_ids, self.scheduler_config.max_model_len)
            if seq.matcher is not None and not seq.is_finished() and seq.matcher.is_finished:
                seq.status = SequenceStatus.FINISHED_STOPPED  # the grammar is complete: as a stop
        except Exception as exc:
            self._fail_request(group, exc)

    def _fail_request(self, group: SequenceGroup, exc: Exception) -> None:
        """Per-request fault isolation: processing one request's new token raised (detokenization,
        stop checks, beam bookkeeping). That request ends with finish reason "abort" and a message
        naming the cause; step() frees its blocks and the other requests go on. Failures of the
        device step itself still propagate: then the engine's state is unknown."""
        logger.error("request %s failed and was aborted: %s: %s", group.request_id, type(exc).__name__, exc,
                     exc_info=exc)
        self._failed.add(group.request_id)
        group.finish_message = f"{REQUEST_FAILED}: {type(exc).__name__}: {exc}"
        for seq in group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED

    def _detokenize(self, seq: Sequence, params: SamplingParams) -> str:
        """Incremental detokenization: emit text only once it is stable (no partial UTF-8).
        Without a tokenizer (a simulator's engine) there is no text."""
        if self.tokenizer is None:
            return ""
        t0 = time.perf_counter()
        try:
            return detokenize_incrementally(self._text_decoder, seq, params)
        finally:
            self.timings["detokenize"] += time.perf_counter() - t0

    # ---- statistics ----------------------------------------------------------
    def get_stats(self) -> dict:
        """Blocks, queues, preemptions, KV-cache usage, compilations, timings (:func:`paged_jax.engine_stats.engine_stats`)."""
        return engine_stats(self)
