"""The engine end to end on this machine's accelerator: the default model's greedy tokens with each
attention backend and dtype, against the reference backend in float32, and each run's tokens/s.

    python experiments/gpu_engine_check.py [--backends auto reference pallas] [--dtypes float32 bfloat16]

On a CUDA GPU ``auto`` is ``pallas`` (the compiled kernels); on a CPU use ``native`` or
``pallas-interpret`` (slow, for checking this script). Every run's matmuls use
``--matmul-precision`` (default ``highest``: on a GPU JAX's default float32 matmul is TF32, about
1e-3 relative, which would make float32 differ from the oracle for a reason other than the
kernels). The float32 reference runs once, as the oracle. Prints one line per (backend, dtype):
the backend "auto" chose, tokens/s of a second, warm ``generate`` call, and how many requests'
greedy tokens equal the reference's.

Exits 1 when a run fails, when a float32 run's tokens differ from the reference's in any request's
first ``--float32-prefix`` tokens (a kernel bug, not rounding), or when fewer than half the
requests of a 16-bit run agree with the reference on their first token (16-bit rounding may flip
near-ties, and later tokens then go their own way).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from paged_jax import LLM, SamplingParams
from paged_jax.cli import DEMO_PROMPTS


def run(backend: str, dtype: str, prompts, max_tokens: int, precision: str):
    with jax.default_matmul_precision(precision):  # tracing happens inside: the compiled steps use it
        llm = LLM(attention_backend=backend, dtype=dtype, max_model_len=512)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # compiles
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
    chosen = llm.llm_engine.get_stats()["attention_backend"]
    return [list(o.outputs[0].token_ids) for o in outs], len(prompts) * max_tokens / dt, chosen


def agreement(got, want, dtype: str, float32_prefix: int) -> tuple[str, bool]:
    """A line on how ``got`` agrees with the reference's ``want``, and whether that passes."""
    n = float32_prefix if dtype == "float32" else 1
    same = sum(g == w for g, w in zip(got, want))
    prefix = sum(g[:n] == w[:n] for g, w in zip(got, want))
    ok = prefix == len(want) if dtype == "float32" else 2 * prefix >= len(want)
    return f"greedy equal to reference float32: {same}/{len(want)} requests (first {n}: {prefix}/{len(want)})", ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["auto", "reference"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--float32-prefix", type=int, default=8,
                    help="float32 runs must equal the reference in every request's first this many tokens")
    ap.add_argument("--matmul-precision", default="highest", choices=["default", "high", "highest"])
    a = ap.parse_args(argv)
    prompts = (DEMO_PROMPTS * (a.num_prompts // len(DEMO_PROMPTS) + 1))[:a.num_prompts]
    print(f"jax {jax.__version__}, devices {jax.devices()}, matmul precision {a.matmul_precision}", flush=True)
    want, rate, _ = run("reference", "float32", prompts, a.max_tokens, a.matmul_precision)
    print(f"{'reference':16s} {'float32':9s} {rate:9.1f} tokens/s   (the oracle)", flush=True)
    failed = 0
    for backend in a.backends:
        for dtype in a.dtypes:
            if (backend, dtype) == ("reference", "float32"):
                continue  # the oracle above
            try:
                got, rate, chosen = run(backend, dtype, prompts, a.max_tokens, a.matmul_precision)
            except Exception as e:  # report and go on: one failing variant must not hide the others
                print(f"{backend:16s} {dtype:9s} FAILED: {type(e).__name__}: {e}", flush=True)
                failed += 1
                continue
            line, ok = agreement(got, want, dtype, a.float32_prefix)
            failed += not ok
            name = backend if chosen == backend else f"{backend}={chosen}"
            print(f"{name:16s} {dtype:9s} {rate:9.1f} tokens/s   {line}{'' if ok else '   FAILED'}", flush=True)
    print(f"{failed} variant(s) failed" if failed else "all variants passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
