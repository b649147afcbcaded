"""The real executor: scheduler output -> padded arrays -> jitted step -> sampled tokens (the
step's own argmax for a greedy batch, else the sampler: ``paged_jax.executor.sampling``).

The KV cache (a list over layers of (k, v) arrays, ``[num_blocks, block_size,
num_kv_heads, head_dim]``) is donated through every jitted call, so it is
updated in place. Batch shapes come from a small set of power-of-two buckets;
``num_compilations`` counts the distinct shapes compiled so far.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention import AUTO, kv_quant, select_backend
from paged_jax.executor import executable_cache
from paged_jax.executor.batch import Batch, prepare_batch, split_steps, tile_capacity, warmup_shapes
from paged_jax.executor.decode_loop import DecodeLoops, multi_step_draws, sampled_draws_for
from paged_jax.executor.draft_rows import drafts_as_rows, verification_chunks, verification_tiles
from paged_jax.executor.interface import RowSampling, Sample, StepResult, check_sampling
from paged_jax.executor.run_ahead import AheadStep, next_decode_batch, same_step
from paged_jax.executor.sampling import StepSampler
from paged_jax.memory import cache_ops
from paged_jax.models import compute_logits, forward
from paged_jax.models.config import ModelConfig
from paged_jax.outputs import make_logprobs_dict
from paged_jax.sampler import greedy_tokens
from paged_jax.scheduler import SchedulerOutput

logger = logging.getLogger("paged_jax")


# The step computes its rows' greedy tokens only up to this many logits (rows x vocabulary, 1 MiB of
# float32): below it the argmax costs about half the LM head's matmul, a few percent of the step, paid
# for nothing by a batch that samples; past it its passes leave the caches (a [256, 50257] argmax took
# 36 ms on the benchmark CPU, one [64, 50257] 2.6 ms): those batches take the sampler.
GREEDY_IN_STEP_MAX_LOGITS = 1 << 18
# Where that bound applies. On a GPU the argmax is one cheap reduction at any size, and a greedy batch
# without it takes the sampler's own call (its tensors built on the host, a second dispatch, a second
# read): on the H200 a 32-row GPT-2 batch (1.6M logits) spent a third of its step in "sample".
GREEDY_IN_STEP_BOUNDED_PLATFORMS = ("cpu",)


class StepOutput(NamedTuple):
    """What the jitted step returns beside the KV cache."""

    logits: jax.Array  # float[rows, V]: each sequence's last token's, or every token's (all_logits)
    # Each sequence's argmax and its logprob (paged_jax.sampler.greedy_tokens), computed in the step so
    # that a greedy batch needs no sampler call (paged_jax.executor.sampling); None with all_logits or
    # more than GREEDY_IN_STEP_MAX_LOGITS logits on a CPU.
    greedy_ids: Optional[jax.Array] = None  # int32[rows]
    greedy_logprobs: Optional[jax.Array] = None  # float32[rows]


def make_step(config: ModelConfig, attn, kv_layout=None):
    """The step function the runner jits: ``step(params, kv_caches, batch, all_logits) -> (StepOutput,
    kv_caches)`` for attention backend ``attn`` (an object, used as given: no availability check,
    so a step for another platform can be lowered here). ``all_logits`` is static: the logits of
    every token, or of each sequence's last one and (up to ``GREEDY_IN_STEP_MAX_LOGITS``) its greedy
    token. ``kv_layout``: the cache's layer groups (``forward``)."""

    def step(params, kv_caches, batch: Batch, all_logits: bool):
        hidden, kv_caches = forward(params, config, batch.input_ids, batch.positions, kv_caches, batch, attn,
                                    rope_lengths=batch.rope_lengths, kv_layout=kv_layout)
        if all_logits:
            return StepOutput(compute_logits(params, config, hidden)), kv_caches
        logits = compute_logits(params, config, hidden[batch.last_token])
        if logits.size > GREEDY_IN_STEP_MAX_LOGITS and jax.default_backend() in GREEDY_IN_STEP_BOUNDED_PLATFORMS:
            return StepOutput(logits), kv_caches
        ids, logprobs = greedy_tokens(logits)
        # Padded rows' argmax is 0, their input id: a step run ahead on these ids is the step the
        # engine prepares (paged_jax.executor.run_ahead).
        return StepOutput(logits, jnp.where(batch.query_lens > 0, ids, 0), logprobs), kv_caches

    return step


def on_param_leaves(model_step, param_tree):
    """``model_step(params, ...)`` taking the weights as ``param_tree``'s list of leaves instead (named
    ``step`` still: traces, profiles and the compile events name the step so)."""

    def step(param_leaves, kv_caches, batch, all_logits):
        return model_step(jax.tree.unflatten(param_tree, param_leaves), kv_caches, batch, all_logits)

    return step


class ModelRunner:
    def __init__(self, config: ModelConfig, params, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 attention_backend: str = "auto", seed: int = 0, mesh=None, native_kernels: bool = True,
                 compile_cache_dir=None, kv_layout=None):
        """``params``: as :func:`paged_jax.executor.loading.load_for_serving` readies them (the runner
        takes them as they are). ``attention_backend``: a registered backend's name, checked against every layer's
        :class:`AttentionSpec` and the dtype (ValueError if it refuses), or ``"auto"`` (see
        :func:`select_backend`; the reference under tensor parallelism). ``mesh``: tensor
        parallelism (``paged_jax.parallel``): params already sharded on it, the KV cache split
        over KV heads, the attention backend run per device in shard_map. ``kv_layout``: a
        :class:`~paged_jax.memory.KVLayout` with several layer groups (None: one array pair per layer)."""
        self.config, self.params, self.block_size = config, params, block_size
        # The step (and a draft model's loop) takes the weights as their flat list of leaves, fixed
        # here: each launch then flattens a list, where the weight tree's custom nodes cost about
        # 57 us a call (62 leaves). ``params`` stays the tree, for reading.
        self.param_leaves, self.param_tree = jax.tree.flatten(params)
        self.kv_layout = kv_layout if kv_layout is not None and kv_layout.num_groups > 1 else None
        self.num_layer_groups = 1 if self.kv_layout is None else self.kv_layout.num_groups
        if mesh is not None and attention_backend == AUTO:
            # the native and Pallas kernels inside shard_map are untested: "auto" runs the reference there
            logger.info("tensor parallelism: attention_backend 'auto' runs 'reference' on each device")
            attention_backend = "reference"
        cache_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        self.attn = select_backend(attention_backend, [config.attention_spec(i) for i in range(config.num_layers)],
                                   cache_dtype, native_kernels=native_kernels)
        self.attention_backend = self.attn.name
        # Speculative decoding: a row with drafts runs its tokens as one query tile where the backend
        # declares its tiles cost their queries (native, Pallas), else as a decode row per token.
        self.drafts_as_rows = drafts_as_rows(self.attn)
        self.seed = seed
        self.mesh, self.kv_sharding, out_shardings = mesh, None, None
        if mesh is not None:
            from paged_jax import parallel

            self.attn = parallel.shard_backend(self.attn, mesh)
            self.kv_sharding = parallel.kv_cache_sharding(mesh)
            out_shardings = (parallel.replicated(mesh), self.kv_sharding)
        num_arrays = config.num_layers if self.kv_layout is None else self.kv_layout.num_slots
        shape = dict(num_layers=num_arrays, block_size=block_size, num_kv_heads=config.num_kv_heads,
                     head_dim=kv_quant.cache_head_dim(config.head_dim, config.kv_cache_dtype),
                     dtype=kv_quant.storage_dtype(config.kv_cache_dtype, config.dtype))
        self.kv_caches = cache_ops.allocate_kv_caches(num_blocks=num_gpu_blocks, sharding=self.kv_sharding, **shape)
        self.host_pool = cache_ops.allocate_host_pool(num_blocks=num_cpu_blocks, **shape)
        self._compiled: set = set()
        self._executables: dict = {}  # (shape_key, all_logits) -> compiled step, filled by warm_up
        self._functions: dict = {}  # (name, abstract arguments) -> compiled sampler, see _call
        self.sampler = StepSampler(config.vocab_size, seed, self._call)
        self._loop_rng = np.random.default_rng(seed)  # multi-step decoding's unseeded draws
        step = on_param_leaves(make_step(config, self.attn, self.kv_layout), self.param_tree)
        self._step = jax.jit(step, static_argnums=(3,), donate_argnums=(1,), out_shardings=out_shardings)
        # Multi-step decoding's loops of this step (execute_steps): on one device, one layer group.
        self.decode_loops = DecodeLoops(step, block_size, config.vocab_size) if mesh is None and self.kv_layout is None else None
        # Compiled steps on disk (None when off): a fresh process skips tracing and lowering.
        self.executable_cache = executable_cache.for_runner(config, self.attn, self.params, self.kv_caches, mesh,
                                                            compile_cache_dir)
        self.timings = {"prepare": 0.0, "cache_ops": 0.0, "device": 0.0, "sample": 0.0}
        # The next decode step, dispatched before this one's tokens are read (paged_jax.executor.run_ahead):
        # on one device, one layer group; the engine turns it off with speculative decoding.
        self.run_ahead = self.decode_loops is not None
        self._ahead: Optional[AheadStep] = None
        self.num_steps_run_ahead = 0  # steps whose outputs were taken from a step run ahead

    @property
    def num_compilations(self) -> int:
        """Distinct step shapes compiled (``(Batch.shape_key, all_logits)``), plus sampler variants
        (this runner's from the executable cache, else process-wide) and cache-op shapes (process-wide)."""
        return (len(self._compiled) + len(self._functions) + StepSampler.num_compilations()
                + sum(cache_ops.num_compiled_shapes().values())
                + (len(self.decode_loops.compiled) if self.decode_loops is not None else 0))

    def run_batch(self, batch: Batch, all_logits: bool = False) -> jax.Array:
        """The forward pass; returns the logits (on the device) of each row's last token, or of every token."""
        return self.run_step(batch, all_logits).logits

    def run_step(self, batch: Batch, all_logits: bool = False) -> StepOutput:
        """The forward pass; returns its :class:`StepOutput` (on the device)."""
        key = (batch.shape_key, all_logits)
        self._compiled.add(key)
        compiled = self._executables.get(key)
        if compiled is None and self.executable_cache is not None:  # first use: load or compile, and store
            compiled = self._executables[key] = self._compile(batch, all_logits)
        if compiled is not None:
            step_out, self.kv_caches = compiled(self.param_leaves, self.kv_caches, batch)
        else:
            step_out, self.kv_caches = self._step(self.param_leaves, self.kv_caches, batch, all_logits)
        return step_out

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                sampling_params=None, eos_token_id: Optional[int] = None, progress: bool = True,
                num_speculative_tokens: int = 0, return_probs: bool = False, num_scheduler_steps: int = 1) -> int:
        """Compile up front every step shape a run can reach (see :func:`warmup_shapes`),
        ahead of time (nothing runs on the device), and the sampler for every row bucket
        with ``sampling_params`` (default: greedy). With ``num_speculative_tokens`` (speculative
        decoding) also the verification steps (:func:`verification_chunks`): decode shapes of up to a
        row per token of the step, or the prefill shapes computing every token's logits; and the
        sampler and row selection for up to one sampler row per token. ``return_probs``: the
        sampled params' processed distributions too (a draft model's sampled drafts). With
        ``num_scheduler_steps`` > 1 also the decode loops of that many steps (:meth:`execute_steps`).
        Returns the number of step shapes compiled."""
        max_rows = max_num_seqs  # sampler rows; with drafts, up to one per token of the step
        if num_speculative_tokens:
            max_rows = max(max_num_seqs, min(max_num_batched_tokens, max_num_seqs * (num_speculative_tokens + 1)))
        decode_rows = max_rows if self.drafts_as_rows else max_num_seqs
        reachable = warmup_shapes(decode_rows, max_num_batched_tokens, max_model_len, self.block_size)
        # Drafts run as query tiles: the prefill shapes, with every token's logits.
        tiles = num_speculative_tokens and not self.drafts_as_rows
        verify = [((t, s, b, verification_tiles(t)), True) for t, s, b, n in reachable if n] if tiles else []
        shapes = [key for key in [(k, False) for k in reachable] + verify if key not in self._executables]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(shapes), desc="Compiling step shapes", dynamic_ncols=True)
        try:
            for key, all_logits in shapes:
                batch = Batch.abstract(key, self.num_layer_groups)
                self._executables[(key, all_logits)] = self._compile(batch, all_logits)
                self._compiled.add((key, all_logits))
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        if num_scheduler_steps > 1 and self.decode_loops is not None:  # greedy, and drawing with sampling_params
            self.decode_loops.warm_up(num_scheduler_steps, self.param_leaves, self.kv_caches, max_num_seqs,
                                      max_model_len, sampled_draws_for(sampling_params, num_scheduler_steps,
                                                                       self.config.vocab_size, keyed=True),
                                      return_q=False)
        # The sampler for every row bucket, and the row selection out of each prefill shape's logits.
        self.sampler.warm_up(max_rows, [t for (t, _, _, tiles), _ in shapes if tiles], sampling_params, eos_token_id,
                             return_probs)
        return len(shapes)

    def _call(self, name: str, fn, *args):
        """``fn(*args)``, for ``fn`` the sampler or ``_take_rows`` (module-level jits of paged-jax).
        With the executable cache on, each variant (abstract arguments) is loaded from it, or compiled
        and stored, once per runner: a fresh process does not trace them."""
        if self.executable_cache is None:
            return fn(*args)
        leaves, treedef = jax.tree.flatten(args)
        key = (name, treedef, *((x.shape, x.dtype) for x in leaves))
        compiled = self._functions.get(key)
        if compiled is None:
            compiled = self._functions[key] = self.executable_cache.get_function(name, args,
                                                                                 lambda: fn.lower(*args))
        return compiled(*args)

    def _compile(self, batch: Batch, all_logits: bool) -> "jax.stages.Compiled":
        """The step compiled for ``batch``'s shape (arrays or ``Batch.abstract``): from the executable
        cache when it holds it (stored there when compiled here), else lowered and compiled."""
        def lower():
            return self._step.lower(self.param_leaves, self.kv_caches, batch, all_logits)

        if self.executable_cache is None:
            return lower().compile()
        return self.executable_cache.get(batch.shape_key, all_logits, lower)

    def _dispatch_ahead(self, batch: Batch, out: SchedulerOutput, sampling: Sequence[RowSampling], ids) -> None:
        """Dispatch the decode step after ``batch`` (rows ``out.scheduled``), its input ids ``ids`` (the
        device's argmax of ``batch``), when it is known now (:func:`next_decode_batch`)."""
        nxt = next_decode_batch(batch, out, sampling, self.block_size, ids)
        if nxt is not None:
            self._ahead = AheadStep(nxt, ids, self.run_step(nxt))

    # ---- one engine step -----------------------------------------------------
    def _run_cache_ops(self, out: SchedulerOutput) -> None:
        t0 = time.perf_counter()
        if out.blocks_to_swap_out:
            cache_ops.swap_out(self.kv_caches, self.host_pool, out.blocks_to_swap_out)
        if out.blocks_to_swap_in:
            self.kv_caches = cache_ops.swap_in(self.kv_caches, self.host_pool, out.blocks_to_swap_in)
        if out.blocks_to_copy:
            src, dst = zip(*out.blocks_to_copy)
            self.kv_caches = cache_ops.copy_blocks(self.kv_caches, list(src), list(dst))
        self.timings["cache_ops"] += time.perf_counter() - t0

    def execute_steps(self, out: SchedulerOutput, sampling: Sequence[RowSampling], limits: Sequence[int],
                      num_steps: int, eos_token_id: Optional[int] = None) -> StepResult:
        """Multi-step decoding (``paged_jax.multi_step``): ``num_steps`` one-token steps of ``out``'s decode
        rows in one jitted call (``paged_jax.executor.decode_loop``), each step's token the next one's
        input. Row ``i`` runs its pending token at ``start_pos`` and keeps ``limits[i]`` tokens, its table
        covering their slots. Every row asks for one token and at most its logprob (``loop_decodable``):
        a greedy row's is the plain argmax, a random row's is drawn in the loop as the sampler draws it
        (a seeded row at the sampler's own uniforms); its samples are the steps' tokens and logprobs (the
        logprobs entry with ``logprobs=0``), in order."""
        check_sampling(out, sampling)
        self._run_cache_ops(out)
        self._ahead = None  # a step run ahead is dropped: the loop's first step writes its K/V slot again
        t0 = time.perf_counter()
        rows = out.scheduled
        tokens = [row.seq.get_token_ids()[row.start_pos] for row in rows]
        ids, logprobs, self.kv_caches = self.decode_loops.run(
            num_steps, self.param_leaves, self.kv_caches, tokens, [row.start_pos for row in rows],
            [row.block_table for row in rows], list(limits),
            lambda num_rows: multi_step_draws(rows, sampling, limits, num_steps, num_rows, self.config.vocab_size,
                                              eos_token_id, self._loop_rng))
        t1 = time.perf_counter()
        self.timings["device"] += t1 - t0
        result = StepResult()
        for i, (n, spec) in enumerate(zip(limits, sampling)):
            result.samples[i] = [Sample(int(ids[j, i]), float(logprobs[j, i]), None if spec.logprobs is None
                                        else make_logprobs_dict(ids[j, i], logprobs[j, i], num=0)) for j in range(n)]
        self.timings["sample"] += time.perf_counter() - t1
        return result

    def execute(self, out: SchedulerOutput, sampling: Sequence[RowSampling] = (),
                eos_token_id: Optional[int] = None) -> StepResult:
        """Run ``out``'s cache operations and forward pass, and draw what ``sampling`` asks.

        Row ``i`` of ``out.scheduled`` gets one sample per seed in ``sampling[i].seeds``
        (with its top-N logprobs entry and its best candidates when asked for), and the
        prompt logprobs of the prompt tokens it ran when ``sampling[i].prompt_logprobs`` is set.
        What the samples mean (best_of fan-out, beams) is the engine's business.
        """
        check_sampling(out, sampling)
        self._run_cache_ops(out)
        result = StepResult()
        if not out.scheduled:
            return result
        chunks, owners = verification_chunks(out, sampling, self.drafts_as_rows)
        want_prompt = [i for i, s in enumerate(sampling) if s.prompt_logprobs is not None]
        # Prompt logprobs, and drafts run as query tiles, need more than each row's last token's logits.
        verifying = not self.drafts_as_rows and any(j is not None for _, j in owners)
        all_logits = bool(want_prompt) or verifying
        # One ragged batch for the whole step (split only if its prefills need more query tiles
        # than its token bucket holds: many short prompts at once; a verification step has room for all).
        capacity = verification_tiles if verifying else tile_capacity
        parts = [list(range(len(chunks)))] if verifying else split_steps(chunks)
        # The step run ahead by the last call, if any: taken below if this is that step, else dropped.
        ahead, self._ahead = self._ahead, None
        if all_logits or len(parts) > 1 or out.blocks_to_swap_in or out.blocks_to_swap_out or out.blocks_to_copy:
            ahead = None
        for part in parts:
            t1 = time.perf_counter()
            batch = prepare_batch([chunks[i] for i in part], self.block_size, capacity=capacity)
            t2 = time.perf_counter()
            self.timings["prepare"] += t2 - t1
            # No wait between the step and the sampler: the step is dispatched, and while the device
            # runs it the host builds the sampling arrays and queues the sampler behind it, so that
            # this host work and the sampler's dispatch hide under the step (at small batches they
            # were a tenth of the step). The one wait is for the samples.
            if ahead is not None and same_step(ahead, batch):
                step_out = ahead.step_out  # dispatched by the last call, running or done
                self.num_steps_run_ahead += 1
            else:
                step_out = self.run_step(batch, all_logits=all_logits)
            t3 = time.perf_counter()
            pending = self.sampler.dispatch(out, sampling, [owners[c] for c in part], step_out, batch, all_logits,
                                            eos_token_id, self.drafts_as_rows)
            t4 = time.perf_counter()
            if self.run_ahead and len(parts) == 1 and self.sampler.reads_step_argmax(pending, step_out):
                self._dispatch_ahead(batch, out, sampling, step_out.greedy_ids)
            # Waiting for the step here (the sampler is already queued behind it) costs no overlap and
            # keeps the device time apart from sampling's: "device" is the step's dispatch (and the next
            # step's, run ahead) plus what is left of the step once the host work above is done.
            jax.block_until_ready(step_out)
            t5 = time.perf_counter()
            self.timings["device"] += (t3 - t2) + (t5 - t4)
            self.sampler.collect(sampling, pending, result)
            for b, (i, _) in enumerate(owners[c] for c in part):
                if i in want_prompt:
                    result.prompt_logprobs[i] = self.sampler.prompt_logprobs(
                        out.scheduled[i], sampling[i].prompt_logprobs, step_out.logits, batch, b)
            self.timings["sample"] += (t4 - t3) + (time.perf_counter() - t5)
        return result
