"""The engine end to end on this machine's accelerator: the default model's greedy tokens with each
attention backend and dtype, against the reference backend in float32, and each run's tokens/s.

    python experiments/gpu_engine_check.py [--backends reference pallas] [--dtypes float32 bfloat16]

On a CUDA GPU the ``pallas`` backend runs the compiled kernels; elsewhere use ``pallas-interpret``
(slow, for checking this script). Prints one line per (backend, dtype): tokens/s of a second, warm
``generate`` call, and how many of the requests' greedy tokens equal the float32 reference's
(bfloat16 may differ after a few tokens: low precision, not a bug, when the first tokens agree).
"""

from __future__ import annotations

import argparse
import time

import jax

from paged_jax import LLM, SamplingParams
from paged_jax.cli import DEMO_PROMPTS


def run(backend: str, dtype: str, prompts, max_tokens: int):
    llm = LLM(attention_backend=backend, dtype=dtype, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], len(prompts) * max_tokens / dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["reference", "pallas"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    prompts = (DEMO_PROMPTS * (a.num_prompts // len(DEMO_PROMPTS) + 1))[:a.num_prompts]
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    want, _ = run("reference", "float32", prompts, a.max_tokens)
    for backend in a.backends:
        for dtype in a.dtypes:
            try:
                got, rate = run(backend, dtype, prompts, a.max_tokens)
            except Exception as e:  # report and go on: one failing variant must not hide the others
                print(f"{backend:16s} {dtype:9s} FAILED: {type(e).__name__}: {e}")
                continue
            same = sum(g == w for g, w in zip(got, want))
            first = sum(g[:4] == w[:4] for g, w in zip(got, want))
            print(f"{backend:16s} {dtype:9s} {rate:9.1f} tokens/s   greedy equal to reference float32: "
                  f"{same}/{len(want)} requests (first 4 tokens: {first}/{len(want)})")


if __name__ == "__main__":
    main()
