"""Cold start: a fresh process's ``LLM(...)`` and first ``generate``, with an empty cache, with JAX's
persistent compilation cache only, and with the serialized step executables, side by side.

    python experiments/bench_cold_start.py [--rounds 2] [--num-prompts 48] [--output-len 64]

Each row is a new child process (``--child``) on the same model and requests: the GPT-2-shaped model
of experiments/bench_peers.py (512 wide, 8 layers, 8 heads, float32, random weights; its vocabulary is
what the bundled tokenizer learns, about 700 tokens), prompts of 16-160 tokens (uniform, seeded), every
request ``--output-len`` tokens, greedy, all at once. Per round, in two new cache directories:

- ``empty``: nothing cached, the default settings (this run stores the step executables);
- ``executables``: the default second start, loading them;
- ``empty, no executables``: nothing cached, ``PAGED_JAX_NO_EXECUTABLE_CACHE=1`` (JAX's persistent
  cache alone, as before the executables; this run fills it);
- ``JAX cache only``: the second start of that (tracing and lowering every step shape, XLA's compile
  read from JAX's cache).

A step compiled for the executable cache is not written to JAX's persistent cache (see
``paged_jax/executor/executable_cache.py``), hence the two directories.

Printed per row: ``LLM(...)`` seconds, time to first token of the first call (from ``generate``),
the first call's and the same process's second call's output tokens/s, the first over the second,
the entries the executable cache loaded (step shapes and sampler variants; and the seconds that took)
and stored, and the seconds JAX spent tracing, lowering and compiling the step and everything else
(sampler, cache ops, ``LLM()``'s own jits). The machine is shared: compare
rows within one round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import this checkout's paged_jax
    sys.path.insert(0, str(ROOT))
OFF = {"PAGED_JAX_NO_EXECUTABLE_CACHE": "1"}
# (row, cache directory of the round, extra environment), in the order they run
MODES = [("empty", "a", {}), ("executables", "a", {}),
         ("empty, no executables", "b", OFF), ("JAX cache only", "b", OFF)]


def child(model: str, num_prompts: int, output_len: int) -> dict:
    """One fresh process's cold start (run with ``--child``)."""
    t_import = time.perf_counter()
    import jax.monitoring

    compile_s = Counter()

    def listen(event, seconds, fun_name="", **_):
        if event.startswith("/jax/core/compile/"):
            compile_s["step" if fun_name in ("step", "jit(step)") else "other"] += seconds

    jax.monitoring.register_event_duration_secs_listener(listen)
    import numpy as np

    from paged_jax import LLM, SamplingParams

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(16, 161, size=num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=256, max_num_seqs=num_prompts, seed=0)
    t1 = time.perf_counter()
    engine, first_token = llm.llm_engine, []
    step = engine.step

    def timed_step():  # the moment the first step hands back a token
        outs = step()
        if not first_token and any(o.outputs and o.outputs[0].token_ids for o in outs):
            first_token.append(time.perf_counter())
        return outs

    engine.step = timed_step
    runs = []
    for _ in range(2):
        first_token.clear()
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"elapsed": elapsed, "ttft": first_token[0] - start, "tok_s": made / elapsed})
    cache = engine.runner.executable_cache
    return {"import_s": t0 - t_import, "llm_s": t1 - t0, "first": runs[0], "second": runs[1],
            "loaded": cache.loaded if cache else 0, "stored": cache.stored if cache else 0,
            "load_s": cache.load_seconds if cache else 0.0,
            "compile_step_s": compile_s["step"], "compile_other_s": compile_s["other"],
            "tokens": [o.outputs[0].token_ids for o in outs][:4]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model", default=None, help="model folder (default: the GPT-2-shaped one, made here)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.model, a.num_prompts, a.output_len)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from paged_jax.models.tiny import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "model", family="gpt2", vocab_size=1024, n_embd=512, n_layer=8,
                                        n_head=8, n_positions=512))
        print(f"{a.num_prompts} requests, prompts 16-160 tokens, {a.output_len} output tokens each; "
              "a fresh process per row")
        print(f"{'round':>5} {'cache':<22} {'LLM() s':>8} {'TTFT s':>7} {'1st tok/s':>10} {'2nd tok/s':>10} "
              f"{'1st/2nd':>8} {'loaded':>7} {'load s':>7} {'stored':>7} {'step compile s':>15} {'other compile s':>16}")
        tokens = None
        for r in range(a.rounds):
            for mode, directory, extra in MODES:
                cache = Path(tmp) / f"cache-{r}{directory}"  # empty at the start of each round
                env = dict(os.environ, PAGED_JAX_COMPILE_CACHE=str(cache), JAX_PLATFORMS="cpu", **extra)
                for k in ("PAGED_JAX_NO_COMPILE_CACHE", "PAGED_JAX_NO_EXECUTABLE_CACHE"):
                    if k not in extra:
                        env.pop(k, None)
                res = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--num-prompts",
                                      str(a.num_prompts), "--output-len", str(a.output_len)],
                                     env=env, cwd=ROOT, capture_output=True, text=True)
                if res.returncode != 0:
                    raise RuntimeError(f"{mode} run failed:\n{res.stderr[-3000:]}")
                s = json.loads(res.stdout.strip().splitlines()[-1])
                tokens = tokens or s["tokens"]
                same = "" if s["tokens"] == tokens else "  (tokens differ!)"
                f, n = s["first"], s["second"]
                print(f"{r:>5} {mode:<22} {s['llm_s']:8.2f} {f['ttft']:7.2f} {f['tok_s']:10.1f} {n['tok_s']:10.1f} "
                      f"{f['tok_s'] / n['tok_s']:8.2f} {s['loaded']:7d} {s['load_s']:7.2f} {s['stored']:7d} {s['compile_step_s']:15.2f} "
                      f"{s['compile_other_s']:16.2f}{same}", flush=True)


if __name__ == "__main__":
    main()
