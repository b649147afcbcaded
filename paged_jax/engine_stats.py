"""The engine's statistics: blocks and KV-cache usage, queues, preemptions, compilations, where the
time went, and the latency target's and speculative decoding's own figures."""

from __future__ import annotations


def engine_stats(engine) -> dict:
    """What ``LLMEngine.get_stats()`` reports, in one dict (the keys are documented beside them)."""
    usage = engine.block_manager.get_usage()
    bm = engine.block_manager
    return {
        "num_total_blocks": usage.num_total_gpu_blocks,
        "num_free_blocks": bm.get_num_free_gpu_blocks(),
        "num_total_cpu_blocks": bm.cpu_allocator.num_total_blocks,
        "num_free_cpu_blocks": bm.get_num_free_cpu_blocks(),
        "num_running": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "num_swapped": len(engine.scheduler.swapped),
        "num_preemptions": dict(engine.scheduler.num_preemptions),
        "kv_cache_usage": usage.num_used_gpu_blocks / max(1, usage.num_total_gpu_blocks),
        "kv_utilization": usage.utilization,
        "num_compilations": engine.runner.num_compilations,
        "attention_backend": getattr(engine.runner, "attention_backend", None),  # the model runner's choice; None in a simulator
        "num_generated_tokens": engine.num_generated_tokens,
        "num_steps": engine.num_steps,
        # Seconds spent: engine (schedule = scheduler + block manager; process = appending tokens,
        # stop checks and freeing, detokenize included) and executor (prepare = batch arrays,
        # cache_ops, device = jitted forward, sample).
        "timings": {**engine.timings, **engine.runner.timings},
        # With target_itl_ms: the step-cost model's coefficients (seconds per unit of each term), its
        # median relative prediction error and the prefill chunk sizes chosen (paged_jax.step_cost).
        "target_itl_ms": engine.scheduler_config.target_itl_ms,
        "step_cost": engine.scheduler.step_cost.stats() if engine.scheduler.step_cost else None,
        # With speculative_config: drafts, acceptance (paged_jax.spec_decode.decoder.SpecDecodeStats)
        "spec_decode": engine.spec_decoder.get_stats() if engine.spec_decoder is not None else None,
        # With num_scheduler_steps > 1: the engine steps that ran several decode steps (paged_jax.multi_step)
        "multi_step": engine.multi_step.get_stats() if engine.multi_step is not None else None,
    }
