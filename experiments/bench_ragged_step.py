"""The ragged step against the code before it, side by side in one run: the same measurements on
this checkout and on an earlier revision of the repository (a git worktree made for the run),
each in fresh child processes, alternating, on one model folder.

    python experiments/bench_ragged_step.py [--before REV] [--prompt-len 4000] [--streams 16]

``--before`` defaults to the last commit before the ragged step (``RAGGED_BASE``). The model is
the stutter benchmark's GPT-2-shaped one (512 wide, 8 layers, 8 heads, vocabulary 1,024 asked, 703 in the tokenizer, random,
float32), every engine with default options (chunked prefill on, its default token budget):

- *warm-up*: step shapes ``warm_up`` compiles, and its seconds, JAX's persistent compilation cache
  off (``max_num_seqs`` 256, ``max_model_len`` 512);
- *prefill*: 48 prompts of 16-160 tokens (uniform, seeded), one output token each, all at once:
  prompt tokens/s of a second, warm call;
- *throughput*: ``bench_throughput.py --dataset sharegpt-like`` requests (``--num-prompts``, lengths
  scaled to 512), all at once, output tokens/s of a second, warm call;
- *stutter*: ``bench_long_prompt.py --stutter``'s scenario at default options: ``--streams``
  streams decode, a ``--prompt-len`` prompt arrives; the streams' max and p99 gap during its prefill
  over their median gap before, and its time to first token over the same prompt alone.

Each measurement runs ``--repeats`` times per revision, the revisions alternating, and the best
run's figure is kept (a shared machine only slows a run down); each is printed per revision with
the ratio after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAGGED_BASE = "4234a77"  # main before the ragged step
MODEL = dict(family="gpt2", vocab_size=1024, n_embd=512, n_layer=8, n_head=8)
HIGHER_IS_BETTER = {"prompt_tokens_per_s", "output_tokens_per_s", "steps_every_stream_served"}


def child(tree: str, model: str, what: str, a) -> dict:
    """One measurement with ``tree``'s paged_jax (first on the path), printed as JSON."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_common  # noqa: F401  (this checkout's experiments; then the tree's package first)

    sys.path.insert(0, tree)
    import numpy as np

    from paged_jax import LLM, SamplingParams

    assert Path(__import__("paged_jax").__file__).resolve().is_relative_to(Path(tree).resolve())
    rng = np.random.default_rng(0)
    if what == "warmup":
        llm = LLM(model, max_num_seqs=256, max_model_len=512)
        t = time.perf_counter()
        n = llm.llm_engine.warm_up(progress=False)
        return dict(shapes=n, warmup_s=time.perf_counter() - t)
    if what == "prefill":
        llm = LLM(model, max_num_seqs=256, max_model_len=512)
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(16, 161, size=48)]
        greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for _ in range(2):  # the second call is timed
            t = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
            s = time.perf_counter() - t
        return dict(prompt_tokens_per_s=sum(map(len, prompts)) / s)
    if what == "throughput":
        from bench_common import add_request_args, make_requests, run_paged_jax

        ap = argparse.ArgumentParser()
        add_request_args(ap)
        ra = ap.parse_args(["--dataset", "sharegpt-like", "--num-prompts", str(a.num_prompts)])
        llm = LLM(model, max_num_seqs=256, max_model_len=512)
        requests = make_requests(ra, llm.llm_engine.model_config.vocab_size)
        for _ in range(2):
            res = run_paged_jax(llm, ra, requests)
        return dict(output_tokens_per_s=sum(r.output_len for r in requests) / res["elapsed"])
    if what == "stutter":
        from bench_long_prompt import stutter_alone, stutter_run

        llm = LLM(model, max_model_len=a.prompt_len + 128)
        engine = llm.llm_engine
        runs, alone = [], []
        for rep in range(2):  # the first of each compiles the shapes it reaches
            prompt = rng.integers(3, engine.model_config.vocab_size, size=a.prompt_len).tolist()
            runs.append(stutter_run(engine, a.streams, prompt, 20, 5, rng, f"r{rep}"))
            alone.append(stutter_alone(engine, prompt, f"r{rep}"))
        r = runs[-1]
        med = r["median_gap_before_s"]
        return dict(max_gap_over_median=r["max_gap_during_s"] / med, p99_gap_over_median=r["p99_gap_during_s"] / med,
                    ttft_over_alone=r["ttft_s"] / alone[-1], steps_every_stream_served=r["steps_every_stream_served"],
                    prefill_steps=r["prefill_steps"], decode_step_ms=1e3 * r["decode_step_s"],
                    mixed_step_ms=1e3 * r["mixed_step_s"])
    raise ValueError(what)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=RAGGED_BASE, help="the revision to compare with (git rev)")
    ap.add_argument("--what", nargs="+", default=["warmup", "prefill", "throughput", "stutter"],
                    choices=["warmup", "prefill", "throughput", "stutter"])
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="runs per revision, alternating; the best is kept")
    ap.add_argument("--child", nargs=3, metavar=("TREE", "MODEL", "WHAT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(*a.child, a)), flush=True)
        return
    sys.path.insert(0, str(ROOT))
    from paged_jax.models.tiny import make_tiny_model

    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_common import child_result, revision_checkout

    with tempfile.TemporaryDirectory() as tmp, revision_checkout(a.before) as before:
        model = str(make_tiny_model(os.path.join(tmp, "model"), n_positions=a.prompt_len + 128, **MODEL))
        env = dict(os.environ, PAGED_JAX_NO_COMPILE_CACHE="1")
        results = {}
        for what in a.what:
            for rep in range(a.repeats):
                for name, tree in (("before", before), ("after", str(ROOT))):
                    cmd = [sys.executable, __file__, "--child", tree, model, what, "--prompt-len",
                           str(a.prompt_len), "--streams", str(a.streams), "--num-prompts", str(a.num_prompts)]
                    r = child_result(cmd, f"{name} {what}", env)
                    print(what, name, rep, r, file=sys.stderr, flush=True)
                    # Best of the repeats: a shared machine only ever slows a run down.
                    best = results.setdefault((what, name), r)
                    for k, v in r.items():
                        best[k] = max(best[k], v) if k in HIGHER_IS_BETTER else min(best[k], v)
    print(f"before: {a.before}; after: this checkout; GPT-2-shaped model (512 wide, 8 layers), float32, CPU\n")
    print("| measure | before | after | after / before |\n|---|---:|---:|---:|")
    for what in a.what:
        b, r = results[(what, "before")], results[(what, "after")]
        for k in r:
            ratio = r[k] / b[k] if b.get(k) else float("nan")
            print(f"| {what}: {k} | {b.get(k, float('nan')):.3g} | {r[k]:.3g} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
