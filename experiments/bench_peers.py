"""paged-jax against what a CPU user would otherwise pick, on one model and one set of requests,
in one process: paged-jax's first ``generate`` (tracing and compiling included) and a second, warm
one; Hugging Face ``generate`` one request at a time, in static batches, and with its continuous
batching (``generate_batch``).

    python experiments/bench_peers.py [--num-prompts 48] [--output-len 64] [--hf-batch-size 16]

The model is GPT-2-shaped (512 wide, 8 layers, 8 heads, float32, random weights, made here; its
vocabulary is what the bundled tokenizer learns, about 700 tokens); prompts are 16-160 tokens (uniform, seeded), every request generates ``--output-len``
tokens, greedy, all submitted at once. Prints each run's output tokens/s and paged-jax's ratio over it.
JAX's persistent compilation cache decides how much of the first call is compiling: the script says
whether it held entries when the process started.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_common import Request, load_hf, run_hf, run_paged_jax, summarize

from paged_jax import LLM  # after bench_common, which puts this checkout on the path
from paged_jax.models.tiny import make_tiny_model


def hf_continuous(model, requests: list[Request]) -> dict:
    """transformers' continuous batching (``generate_batch``), greedy; counts the tokens it made."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=requests[0].output_len, do_sample=False,
                              eos_token_id=model.config.eos_token_id, pad_token_id=model.config.eos_token_id)
    t0 = time.perf_counter()
    with torch.no_grad():  # not inference_mode: its cache updates tensors in place
        outs = model.generate_batch(inputs=[r.prompt_token_ids for r in requests], generation_config=config)
    elapsed = time.perf_counter() - t0
    failed = [o.error for o in outs.values() if o.error]
    if failed:
        raise RuntimeError(f"generate_batch failed {len(failed)} requests: {failed[0]}")
    made = sum(len(o.generated_tokens) for o in outs.values())
    return {"elapsed": elapsed, "output_tokens": made}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-sequential-prompts", type=int, default=8)
    ap.add_argument("--model", default=None, help="model folder (default: the GPT-2-shaped one, made here)")
    a = ap.parse_args(argv)
    from paged_jax import envs

    cache = envs.compile_cache_dir()
    cached = sum(1 for _ in cache.glob("*")) if cache is not None and cache.is_dir() else 0
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(make_tiny_model(tmp, family="gpt2", vocab_size=1024, n_embd=512, n_layer=8,
                                               n_head=8, n_positions=512))
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        rng = np.random.default_rng(0)
        requests = [Request(rng.integers(3, vocab, size=int(n)).tolist(), a.output_len)
                    for n in rng.integers(16, 161, size=a.num_prompts)]
        # Fixed output lengths for the shared runners (bench_common reads these fields of ``a``).
        a.use_beam_search, a.temperature, a.n, a.seed = False, 0.0, 1, 0
        rows = {}
        t0 = time.perf_counter()
        llm = LLM(model, max_model_len=256, max_num_seqs=a.num_prompts)
        startup = time.perf_counter() - t0
        rows["paged-jax, first call (one-shot)"] = summarize(requests, run_paged_jax(llm, a, requests))
        rows["paged-jax, second call (warm)"] = summarize(requests, run_paged_jax(llm, a, requests))
        del llm
        hf = load_hf(model)
        sub = requests[:a.hf_sequential_prompts]
        rows[f"HF generate, one at a time (first {len(sub)})"] = summarize(sub, run_hf(hf, a, sub, 1))
        rows[f"HF generate, static batches of {a.hf_batch_size}"] = summarize(requests,
                                                                               run_hf(hf, a, requests, a.hf_batch_size))
        cb = hf_continuous(hf, requests)
        rows["HF continuous batching (generate_batch)"] = {"output_tokens_per_s": cb["output_tokens"] / cb["elapsed"],
                                                           "elapsed_s": cb["elapsed"]}
    print(f"{a.num_prompts} requests, prompts 16-160 tokens, {a.output_len} output tokens each; engine start "
          f"{startup:.1f} s (not in the first call); compilation cache held {cached} entries at start ({cache})")
    one_shot = rows["paged-jax, first call (one-shot)"]["output_tokens_per_s"]
    warm = rows["paged-jax, second call (warm)"]["output_tokens_per_s"]
    print(f"{'run':<46} {'output tok/s':>12} {'one-shot /':>11} {'warm /':>8}")
    for name, s in rows.items():
        r = s["output_tokens_per_s"]
        print(f"{name:<46} {r:12.1f} {one_shot / r:10.2f}x {warm / r:7.2f}x")


if __name__ == "__main__":
    main()
