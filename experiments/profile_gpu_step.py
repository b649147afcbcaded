"""Where an engine step's time goes on whatever JAX backend is there (a GPU above all), in one command.

    python experiments/profile_gpu_step.py [--model DIR] [--num-prompts 64] [--max-num-seqs 32]
        [--max-total-len 256] [--dtype bfloat16] [--attention-backend auto] [--temperatures 0,1] [--top 15]

Builds the GPT-2-124M-shaped model (``bench_common.gpt2_124m_model``; ``--model`` for another, e.g.
``paged_jax/models/data/default-model`` on a CPU) and, for each temperature of ``--temperatures``
(0: greedy; else temperature sampling, top_p 1, top_k 0: vLLM's benchmark), runs a ShareGPT-like
throughput workload (all requests at once, ``bench_throughput.py``'s) twice and prints:

- *split*: the engine's step time by phase (``get_stats()["timings"]``: schedule, prepare, cache_ops,
  device, sample, process), a step's milliseconds each;
- *copies*: the bytes and arrays (one copy each) a step copies host->device (the batch's arrays, the
  sampler's tensors) and device->host (the samples read), and how many of the steps' batches took the sampler's own call
  rather than the step's argmax (``paged_jax.executor.sampling``);
- *trace*: the second run under ``jax.profiler``, its events summed per step by kind (instance numbers
  dropped), split into device events (a GPU's kernels and copies: the trace's ``/device:`` processes)
  and host events (dispatch, XLA:CPU's thunks on a CPU; Python frames left out), the largest ``--top``
  of each. Host events nest (a jitted call holds its thunks): their sums overlap.

On a CPU the device list is empty: XLA:CPU's work is host events. A small run on a CPU:
``python experiments/profile_gpu_step.py --model paged_jax/models/data/default-model --num-prompts 8
--max-num-seqs 4 --max-total-len 64 --dtype float32``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from bench_common import (engine_max_len, gpt2_124m_model, make_llm, make_requests, profiler_events,
                          run_paged_jax)

PHASES = ("schedule", "prepare", "cache_ops", "device", "sample", "process")


def host_arrays(tree) -> list[np.ndarray]:
    """The host (numpy) arrays in ``tree``: what a jitted call copies to the device, one copy each."""
    import jax

    return [x for x in jax.tree.leaves(tree) if isinstance(x, np.ndarray)]


def device_bytes(tree) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


class CopyCounter:
    """Counts, on one engine's model runner, the bytes each step copies each way and the sampler calls."""

    def __init__(self, runner):
        import jax

        self.h2d = self.h2d_arrays = self.d2h = self.d2h_arrays = self.sampler_calls = 0
        run_step, sampler = runner.run_step, runner.sampler
        call, dispatch_sampler, collect = sampler._call, sampler._dispatch_sampler, sampler.collect

        def to_device(tree):
            arrays = host_arrays(tree)
            self.h2d += sum(x.nbytes for x in arrays)
            self.h2d_arrays += len(arrays)

        def counted_run_step(batch, all_logits=False):
            to_device(batch)
            return run_step(batch, all_logits)

        def counted_call(name, fn, *args):
            to_device(args)
            return call(name, fn, *args)

        def counted_dispatch_sampler(*args):
            self.sampler_calls += 1
            return dispatch_sampler(*args)

        def counted_collect(sampling, pending, result):
            if pending is not None:  # what collect reads back: the sample arrays (and probabilities)
                self.d2h += device_bytes(pending[2:])
                self.d2h_arrays += sum(x.size > 0 for x in jax.tree.leaves(pending[2:]))  # empty: no copy
            return collect(sampling, pending, result)

        runner.run_step = counted_run_step
        sampler._call, sampler._dispatch_sampler = counted_call, counted_dispatch_sampler
        sampler.collect = counted_collect

    def snapshot(self) -> np.ndarray:
        return np.array([self.h2d, self.h2d_arrays, self.d2h, self.d2h_arrays, self.sampler_calls], dtype=float)


def trace_events(run) -> list[tuple[bool, str, float]]:
    """``run()`` under jax.profiler: each complete event as (on a device, name, microseconds)."""
    events = profiler_events(run)
    process = {e["pid"]: e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    # Python frames ("$file:line name") nest around everything else: left out.
    return [("/device:" in process.get(e.get("pid"), ""), e["name"], e["dur"])
            for e in events if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("$")]


def by_kind(events, steps: int, top: int) -> dict[bool, list[tuple[str, float, int]]]:
    """The events summed per step by kind (``fusion.12`` -> ``fusion``), the largest ``top`` per side."""
    sums = {True: collections.defaultdict(float), False: collections.defaultdict(float)}
    counts = {True: collections.Counter(), False: collections.Counter()}
    for on_device, name, us in events:
        kind = re.sub(r"([._]\d+)+$", "", name)
        sums[on_device][kind] += us / steps
        counts[on_device][kind] += 1
    return {side: [(k, us, counts[side][k]) for k, us in sorted(s.items(), key=lambda kv: -kv[1])[:top]]
            for side, s in sums.items()}


def profile(llm, a, requests, temperature: float) -> None:
    engine = llm.llm_engine
    a.temperature = temperature
    counter = getattr(engine.runner, "copy_counter", None)
    if counter is None:  # one per runner, for every temperature
        counter = engine.runner.copy_counter = CopyCounter(engine.runner)
    run_paged_jax(llm, a, requests)  # compiles what warm-up left (a sampling variant), untimed
    before = counter.snapshot()
    res = run_paged_jax(llm, a, requests)
    h2d, h2d_arrays, d2h, d2h_arrays, sampler_calls = (counter.snapshot() - before) / res["steps"]
    t, steps = res["timings"], res["steps"]
    total = sum(t[k] for k in ("schedule", "execute", "process"))
    mode = "greedy" if temperature == 0 else f"temperature {temperature} (top_p 1, top_k 0)"
    print(f"\n## {mode}: {steps} steps in {res['elapsed']:.2f} s, {1e3 * total / steps:.2f} ms a step; "
          f"{res['new_compilations']} compilations during the run")
    print("split, ms a step (% of the step): " + ", ".join(
        f"{k} {1e3 * t[k] / steps:.3f} ({100 * t[k] / max(total, 1e-9):.1f}%)" for k in PHASES))
    print(f"copies a step: host->device {h2d / 1e3:.1f} kB in {h2d_arrays:.1f} arrays, device->host "
          f"{d2h / 1e3:.2f} kB in {d2h_arrays:.1f} arrays; "
          f"the sampler's own call in {sampler_calls:.2f} of a step's batches (else the step's argmax)")
    steps_before = engine.num_steps
    try:
        events = trace_events(lambda: run_paged_jax(llm, a, requests))
    except Exception as exc:  # e.g. no CUPTI on a GPU machine: the figures above still stand
        print(f"trace: jax.profiler failed: {type(exc).__name__}: {exc}")
        return
    traced = max(1, engine.num_steps - steps_before)
    for on_device, rows in by_kind(events, traced, a.top).items():
        side = "device (kernels, copies)" if on_device else "host"
        total_us = sum(us for _, us, _ in rows)
        print(f"trace over {traced} steps, {side} events, us a step (largest {a.top}: {total_us:.0f} us):"
              + ("" if rows else " none"))
        for kind, us, n in rows:
            print(f"  {us:10.1f}  {n / traced:7.1f} a step  {kind}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the GPT-2-124M-shaped random model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-total-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated; 0 is greedy")
    ap.add_argument("--top", type=int, default=15, help="the largest so many event kinds per side")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    temps = [float(x) for x in a.temperatures.split(",")]
    if any(x < 0 for x in temps):
        raise SystemExit(f"--temperatures must be >= 0, got {a.temperatures}")
    import jax

    # What bench_common's helpers read: the ShareGPT-like workload of bench_throughput.py.
    a.dataset, a.input_len, a.output_len, a.n, a.use_beam_search = "sharegpt-like", None, None, 1, False
    a.block_size, a.num_kv_blocks, a.max_num_batched_tokens, a.enable_chunked_prefill = 16, None, None, "default"
    a.temperature = temps[0]
    model = a.model or gpt2_124m_model()
    print(f"backend {jax.default_backend()}, devices {jax.devices()}; model {model}")
    t = time.perf_counter()
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    requests = make_requests(a, vocab)
    llm = make_llm(a, model, engine_max_len(a, requests))
    print(f"loaded and warmed up in {time.perf_counter() - t:.1f} s; {len(requests)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in requests)} prompt and {sum(r.output_len for r in requests)} "
          f"output tokens")
    for temperature in temps:
        profile(llm, a, requests, temperature)


if __name__ == "__main__":
    sys.exit(main())
