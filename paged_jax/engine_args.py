"""EngineArgs (the engine's options, vLLM's names and defaults) and the parts an engine is built
from: the model and tokenizer loaded, the scheduler's limits, the KV pool sized in blocks, the
model runner."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from paged_jax.memory.block_manager import BlockManager
from paged_jax.memory.hybrid_block_manager import make_block_manager
from paged_jax.memory.layer_groups import kv_layout
from paged_jax.multi_step import check_num_scheduler_steps
from paged_jax.policy import make_policy
from paged_jax.scheduler import SchedulerConfig, check_target_itl_ms

logger = logging.getLogger("paged_jax")


# Dynamic NTK rotates a prompt's keys for its request's prompt length (ModelConfig.rope_frequencies),
# so blocks computed for one request are wrong for another (forks of one request share its length).
DYNAMIC_ROPE_SHARING = ("prefix sharing across requests (enable_prefix_caching, add_prefix) is not supported with "
                        "dynamic RoPE scaling: a prompt's keys are rotated for its own request's prompt length")


@dataclass
class EngineArgs:
    """The engine's options, with vLLM's names and defaults (see ``LLM``)."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    swap_space: float = 4  # GiB of host memory for swapped-out blocks
    gpu_memory_utilization: float = 0.9  # fraction of accelerator memory (not used on the CPU)
    cpu_kv_cache_space: float = 4  # GiB cap for the KV cache on the CPU
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    preemption_mode: Optional[str] = None
    enable_chunked_prefill: bool = True  # False: the paper's mode, a prompt runs whole in one step
    enable_prefix_caching: bool = False
    # False: samples and beams get copies instead of shared blocks (a baseline for measuring sharing).
    enable_block_sharing: bool = True
    # False: keep the blocks a sliding window has passed (a baseline for measuring what freeing them saves).
    free_blocks_outside_window: bool = True
    attention_backend: str = "auto"  # a backend name; "auto": "pallas" on a GPU, "native" on a CPU where they can
    seed: int = 0
    watermark: float = 0.01
    tensor_parallel_size: int = 1  # devices the model is split over (Megatron-style; paged_jax.parallel)
    quantization: Optional[str] = None  # QUANTIZE_ON_LOAD ("int8", "w8a8", "fp8", "int4", "int4-g128"): linear weights quantized as they load
    kv_cache_dtype: str = "auto"  # "bfloat16": 16-bit cache; "int8" | "fp8": 8-bit, a scale per token and head
    # False: no native CPU kernels in this engine (XLA's matmuls, the jnp attention); None: on where they
    # build, unless PAGED_JAX_NATIVE=0
    native_kernels: Optional[bool] = None
    # The compiled steps on disk (and JAX's persistent compilation cache, which is process-wide: the first
    # engine's folder); None: PAGED_JAX_COMPILE_CACHE or the default folder (see paged_jax.envs)
    compile_cache_dir: Optional[str] = None
    # a name of paged_jax.policy.POLICIES ("fcfs", "short-first", the paper's baselines) or a SchedulingPolicy
    # object; None: "fcfs", or "short-first" with a target_itl_ms
    scheduling_policy: Any = None
    # Milliseconds between tokens that running streams should see while prompts prefill: each step's
    # prefill chunks are sized by a step-cost model fitted online (paged_jax.step_budget). None: today's
    # fixed token budget (max_num_batched_tokens).
    target_itl_ms: Optional[float] = None
    # Speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    # "prompt_lookup_min": m} (paged_jax.spec_decode.SpeculativeConfig); None: off
    speculative_config: Any = None
    # Decode steps per engine step where every row decodes greedily and nothing waits (vLLM's name):
    # k > 1 runs k of them in one jitted call, the engine's host work paid once (paged_jax.multi_step)
    num_scheduler_steps: int = 1

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be an integer in [1, 256], got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2 (one block is the reserved null block), "
                             f"got {self.num_kv_blocks!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        from paged_jax.weights import QUANTIZE_ON_LOAD

        if self.quantization is not None and self.quantization not in QUANTIZE_ON_LOAD:
            raise ValueError(f"quantization must be None or one of {list(QUANTIZE_ON_LOAD)}, "
                             f"got {self.quantization!r}")
        from paged_jax.attention.kv_quant import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        make_policy(self.scheduling_policy)  # refuses an unknown name before anything loads
        if self.native_kernels not in (None, True, False):
            raise ValueError(f"native_kernels must be None, True or False, got {self.native_kernels!r}")
        if self.compile_cache_dir is not None and not isinstance(self.compile_cache_dir, (str, os.PathLike)):
            raise ValueError(f"compile_cache_dir must be a folder path or None, got {self.compile_cache_dir!r}")
        check_target_itl_ms(self.target_itl_ms, self.enable_chunked_prefill)
        if self.speculative_config is not None:
            from paged_jax.spec_decode import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        check_num_scheduler_steps(self.num_scheduler_steps, self.speculative_config, self.target_itl_ms)
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")


# The smallest default token budget with chunked prefill (see default_chunked_budget).
MIN_CHUNKED_BUDGET = 256


def default_chunked_budget(max_num_seqs: int) -> int:
    """The token budget of a step with chunked prefill when none is given: ``max(max_num_seqs, 256)``.

    A step never computes more tokens than a full batch of decodes (``max_num_seqs``), and every
    running sequence's decode token always fits (decodes are served first): so what a stream waits
    while a prompt prefills beside it is about the step time of a full decode batch. The floor of 256 is
    measured (``python experiments/bench_long_prompt.py --stutter``, README "Long prompts"): with 16
    streams decoding and a 4,000-token prompt arriving, budgets of 64 and 128 cut the streams' longest
    gap further but took 1.3-1.9x the prompt's time to first token alone; 256 kept it near 1.1x, and
    512 or 1,024 left about 3x longer gaps than 256."""
    return max(max_num_seqs, MIN_CHUNKED_BUDGET)


@dataclass
class EngineParts:
    model_config: Any  # paged_jax.models.config.ModelConfig
    tokenizer: Any
    eos_token_ids: frozenset
    eos_token_id: Optional[int]
    scheduler_config: SchedulerConfig
    block_manager: BlockManager  # or a HybridBlockManager (several layer groups)
    runner: Any  # paged_jax.executor.model_runner.ModelRunner


def build_engine_parts(args: EngineArgs) -> EngineParts:
    """Load the model (and tokenizer) of ``args``, size the KV pool and build the model runner."""
    from transformers import AutoTokenizer

    from paged_jax.executor.executable_cache import enable_compilation_cache
    from paged_jax.executor.kv_sizing import available_kv_memory, num_blocks_for_memory
    from paged_jax.executor.model_runner import ModelRunner
    from paged_jax.models.tiny import default_model_path
    from paged_jax.executor.loading import load_for_serving
    from paged_jax.spec_decode.draft_model import draft_kv_bytes_per_token, draft_weight_bytes

    from paged_jax import envs

    model_path = str(args.model or default_model_path())
    enable_compilation_cache(args.compile_cache_dir)
    native = envs.native_enabled() if args.native_kernels is None else args.native_kernels
    mc, params, mesh = load_for_serving(model_path, args.dtype, args.tensor_parallel_size, args.quantization,
                                        native_kernels=native)
    mc = dataclasses.replace(mc, kv_cache_dtype=args.kv_cache_dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_path)
    eos = {tokenizer.eos_token_id} | set(mc.eos_token_id or ())
    eos_token_ids = frozenset(e for e in eos if e is not None)
    eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (
        min(eos_token_ids) if eos_token_ids else None)

    max_model_len = args.max_model_len or mc.context_limit
    if max_model_len > mc.context_limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context, {mc.context_limit} "
                         f"(max_position_embeddings={mc.max_position_embeddings}, rope type {mc.rope_type!r})")
    if args.enable_prefix_caching and mc.rope_type == "dynamic":
        raise ValueError(DYNAMIC_ROPE_SHARING)
    budget = args.max_num_batched_tokens or (default_chunked_budget(args.max_num_seqs) if args.enable_chunked_prefill
                                             else max(max_model_len, 2048))
    if args.target_itl_ms is not None and args.max_num_batched_tokens is None:
        # The target sizes the steps; the token budget only caps them (a chunk as large as a 2,048-token step).
        budget = max(budget, min(max_model_len, 2048))
    policy = make_policy(args.scheduling_policy, args.target_itl_ms)
    scheduler_config = SchedulerConfig(args.max_num_seqs, budget, max_model_len, args.preemption_mode,
                                       args.enable_chunked_prefill, policy=policy, target_itl_ms=args.target_itl_ms)
    bs = args.block_size
    # One layer group per attention kind (blocks a window has passed freed in its group), or with
    # free_blocks_outside_window=False one group keeping every block. A block (page) holds
    # layout.num_slots layers: all of them with one group.
    layout = kv_layout([mc.attention_spec(i).sliding_window for i in range(mc.num_layers)],
                       args.free_blocks_outside_window)
    # No pool needs more than every sequence at full length could use in every group (plus the null block).
    cap = args.max_num_seqs * -(-max_model_len // bs) * layout.num_groups + 1
    # A draft model's cache has a block for every block of the pools (the same ids): its K/V count too.
    draft = draft_kv_bytes_per_token(args.speculative_config, mc.dtype)
    if args.num_kv_blocks is not None:
        num_gpu_blocks = args.num_kv_blocks
    else:
        num_gpu_blocks = min(cap, num_blocks_for_memory(
            mc, bs, available_kv_memory(args.gpu_memory_utilization, args.cpu_kv_cache_space, args.tensor_parallel_size,
                                        draft_weight_bytes(args.speculative_config, mc.dtype)), layout.num_slots, draft))
        if num_gpu_blocks < 2:
            raise ValueError("not enough memory for a KV cache: give num_kv_blocks or more memory")
    num_cpu_blocks = min(cap, num_blocks_for_memory(mc, bs, int(args.swap_space * (1 << 30)), layout.num_slots,
                                                    draft))
    # The budget bounds a step's chunk of one sequence: the windowed groups take a prompt's blocks chunk by chunk.
    block_manager = make_block_manager(layout, bs, num_gpu_blocks, num_cpu_blocks, max_num_batched_tokens=budget,
                                       watermark=args.watermark, enable_prefix_caching=args.enable_prefix_caching,
                                       enable_block_sharing=args.enable_block_sharing)
    runner = ModelRunner(mc, params, bs, num_gpu_blocks, num_cpu_blocks, args.attention_backend, args.seed,
                         mesh=mesh, native_kernels=native, compile_cache_dir=args.compile_cache_dir, kv_layout=layout)
    logger.info("paged-jax engine: model=%s family=%s dtype=%s attention=%s blocks=%d x %d tokens (host %d), "
                "max_model_len=%d", model_path, mc.family, mc.dtype, runner.attention_backend, num_gpu_blocks, bs,
                num_cpu_blocks, max_model_len)
    return EngineParts(mc, tokenizer, eos_token_ids, eos_token_id, scheduler_config, block_manager, runner)
