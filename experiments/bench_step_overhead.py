"""Where a small decode step's time goes outside the jitted computation, measured in one process:

    python experiments/bench_step_overhead.py [--batches 1,4] [--calls 200]

On the LLaMA of ``bench_llamacpp.py`` (float32, ``LLM`` defaults), for each batch size, a decode batch
at context 100 and, each figure the minimum and median over ``--calls`` calls:

- the step's call (``ModelRunner.run_step``) when its inputs are ready (XLA may start running it in
  the calling thread before it returns), and right behind another step (its inputs not ready: the
  call's own cost, arguments and all);
- a jitted function over the same arguments (params, donated KV cache, batch) doing nothing: JAX's
  dispatch of that many leaves; and the same with the batch's arrays in one int32 buffer;
- reading the step's greedy ids and logprobs (two ``np.asarray``) once it is done;
- ``prepare_batch`` by the decode path and by the general path, each right after a step (as the
  engine runs it: the step has just streamed the weights through the caches) and again at once;
- whole engine decode steps (``LLMEngine.step``, greedy, 32-token prompts, 64 tokens out), runs
  alternating between the two paths of ``prepare_batch`` (``--engine-runs`` each): the median step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from bench_llamacpp import MODEL


def timed(fn, calls: int) -> tuple[float, float]:
    """(min, median) ms of ``fn()``, which returns the seconds it measured."""
    t = sorted(fn() for _ in range(calls))
    return 1e3 * t[0], 1e3 * t[len(t) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--engine-runs", type=int, default=10)
    a = ap.parse_args(argv)
    from paged_jax import LLM, SamplingParams
    from paged_jax.executor import model_runner
    from paged_jax.executor.batch import SeqChunk, prepare_batch
    from paged_jax.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_tiny_model(os.path.join(tmp, "llama"), **MODEL)), seed=0, max_model_len=256)
    r = llm.llm_engine.runner
    leaves = {k: len(jax.tree.leaves(v)) for k, v in (("params", r.params), ("KV cache", r.kv_caches))}
    print(f"backend {r.attention_backend}; leaves: {leaves}; load average {os.getloadavg()[0]:.1f}\n")
    print("| batch | what | min ms | median ms |\n|---:|---|---:|---:|")
    nothing = jax.jit(lambda params, kv, batch: (kv, batch.input_ids[0]), donate_argnums=(1,))
    nothing_packed = jax.jit(lambda params, kv, data: (kv, data[0]), donate_argnums=(1,))
    for b in a.batches:
        per = -(-100 // r.block_size)
        chunks = [SeqChunk([7], 99, list(range(1 + s * per, 1 + (s + 1) * per))) for s in range(b)]
        batch = prepare_batch(chunks, r.block_size)
        packed = np.concatenate([np.ravel(x) for x in jax.tree.leaves(batch)])
        jax.block_until_ready(r.run_step(batch))

        def call_ready():
            t = time.perf_counter()
            out = r.run_step(batch)
            dt = time.perf_counter() - t
            jax.block_until_ready(out)
            return dt

        def call_behind():
            r.run_step(batch)
            t = time.perf_counter()
            out = r.run_step(batch)
            dt = time.perf_counter() - t
            jax.block_until_ready(out)
            return dt

        def call_nothing(fn, arg):
            def run():
                t = time.perf_counter()
                r.kv_caches, x = fn(r.params, r.kv_caches, arg)
                x.block_until_ready()
                return time.perf_counter() - t
            run()
            return run

        def read():
            out = jax.block_until_ready(r.run_step(batch))
            t = time.perf_counter()
            np.asarray(out.greedy_ids), np.asarray(out.greedy_logprobs)
            return time.perf_counter() - t

        def prepare(decode_path: bool, after_step: bool):
            def run():
                jax.block_until_ready(r.run_step(batch))
                if not after_step:
                    prepare_batch(chunks, r.block_size, decode_path=decode_path)
                t = time.perf_counter()
                prepare_batch(chunks, r.block_size, decode_path=decode_path)
                return time.perf_counter() - t
            return run

        rows = [("step call, inputs ready", call_ready), ("step call behind another step", call_behind),
                (f"jitted nothing over the same {sum(leaves.values()) + len(jax.tree.leaves(batch))} leaves",
                 call_nothing(nothing, batch)),
                ("jitted nothing, the batch as one int32 buffer", call_nothing(nothing_packed, packed)),
                ("read greedy ids and logprobs", read)]
        for path in (True, False):
            for after in (True, False):
                rows.append((f"prepare_batch, {'decode' if path else 'general'} path, "
                             f"{'right after a step' if after else 'run again at once'}", prepare(path, after)))
        for what, fn in rows:
            lo, med = timed(fn, a.calls)
            print(f"| {b} | {what} | {lo:.3f} | {med:.3f} |", flush=True)
        steps = {True: [], False: []}
        engine, params = llm.llm_engine, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for run in range(2 * a.engine_runs):
            path = run % 2 == 0
            model_runner.prepare_batch = lambda *args, path=path, **kw: prepare_batch(*args, decode_path=path, **kw)
            for i in range(b):
                engine.add_request(f"{b}-{run}-{i}", None, params, prompt_token_ids=list(range(3 + i, 35 + i)))
            engine.step()  # the prefill
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                engine.step()
                steps[path].append(time.perf_counter() - t)
        model_runner.prepare_batch = prepare_batch
        for path in (True, False):
            print(f"| {b} | engine decode step, {'decode' if path else 'general'} path (median of "
                  f"{len(steps[path])}) | {1e3 * min(steps[path]):.3f} | {1e3 * float(np.median(steps[path])):.3f} |")


if __name__ == "__main__":
    main()
