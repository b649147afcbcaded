"""Runs engines with tensor parallelism in a process of its own, where JAX sees N CPU devices.

``python -m tests.tp_worker JOBS.json OUT.json``: JOBS.json is ``{"devices": N, "jobs": [...]}``
(plus ``"distributed": {...}``, ``jax.distributed.initialize``'s arguments, for one process of several),
each job ``{"model", "tp", "prompts", "max_tokens", "sampling"?, **engine options}``. For each job OUT.json
gets the greedy token ids and cumulative logprobs, the preemption counts, and the per-device
shard shapes of a few parameters and of the KV cache (read after the run, so after any
swap or copy-on-write). The device count has to be fixed before JAX starts, hence a process.
"""

from __future__ import annotations

import json
import os
import sys

from tests.host_devices import xla_flags_with_devices


def shard_shapes(x) -> list:
    return sorted(list(s.data.shape) for s in x.addressable_shards)


def step_collectives(runner) -> dict:
    """The collectives XLA put in a compiled decode step: {op: [result shapes]}."""
    import re

    from paged_jax.executor.batch import SeqChunk, prepare_batch

    b = prepare_batch([SeqChunk([5], 7, [1]), SeqChunk([6], 3, [2])], runner.block_size)
    hlo = runner._step.lower(runner.param_leaves, runner.kv_caches, b, False).compile().as_text()
    found: dict = {}
    for shape, op in re.findall(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", hlo):
        found.setdefault(op, []).append(shape)
    return found


def run_job(job: dict) -> dict:
    from paged_jax import LLM, SamplingParams
    from paged_jax.memory import cache_ops

    job = dict(job)
    prompts, max_tokens, model, tp = job.pop("prompts"), job.pop("max_tokens"), job.pop("model"), job.pop("tp")
    sampling = job.pop("sampling", {"temperature": 0})
    llm = LLM(model=model, tensor_parallel_size=tp, **job)
    copies, copy_blocks = [], cache_ops.copy_blocks

    def counting_copy(kv_caches, src, dst):
        copies.append(len(src))
        return copy_blocks(kv_caches, src, dst)

    cache_ops.copy_blocks = counting_copy
    try:
        outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                            sampling_params=SamplingParams(max_tokens=max_tokens, **sampling))
    finally:
        cache_ops.copy_blocks = copy_blocks
    engine = llm.llm_engine
    runner, stats = engine.runner, engine.get_stats()
    layer = runner.params["layers"][0]
    shards = {"kv_cache": shard_shapes(runner.kv_caches[0][0]), "embed": shard_shapes(runner.params["embed"].table)}
    for name, leaf in (("q", "w"), ("k", "w"), ("o", "w"), ("up", "w"), ("down", "w"), ("fc1", "w"), ("fc2", "w")):
        if name in layer:
            shards[f"{name}.{leaf}"] = shard_shapes(getattr(layer[name], leaf))
    if "moe" in layer:  # a stack of experts: its first array ([E, ...]) is what the devices split
        import jax

        for name in ("gate", "down"):
            shards[f"experts.{name}"] = shard_shapes(jax.tree.leaves(layer["moe"][name])[0])
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "samples": [[c.token_ids for c in o.outputs] for o in outs],
            "cum_logprobs": [o.outputs[0].cumulative_logprob for o in outs],
            "preemptions": stats["num_preemptions"], "blocks_copied": sum(copies), "shards": shards,
            "num_kv_heads": engine.model_config.num_kv_heads,
            "collectives": step_collectives(runner) if tp > 1 else {},
            "all_free": stats["num_free_blocks"] == stats["num_total_blocks"]}


def main(argv) -> int:
    spec = json.loads(open(argv[0]).read())
    if "jax" in sys.modules:
        raise RuntimeError("JAX was imported before the device count was set")
    os.environ["XLA_FLAGS"] = xla_flags_with_devices(spec["devices"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # tp = 1 is the oracle for tp > 1, which never uses the native CPU kernels: the same code both ways
    os.environ["PAGED_JAX_NATIVE"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "distributed" in spec:  # one of several processes: {"coordinator_address", "num_processes", "process_id"}
        import jax

        jax.distributed.initialize(**spec["distributed"])
    results = [run_job(job) for job in spec["jobs"]]
    with open(argv[1], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
