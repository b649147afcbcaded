"""What quantized weights hold and how fast they decode, side by side with the float model in one run.

    python experiments/bench_quantized.py [--batches 1 8 32] [--tokens 64] [--repeats 3] [--no-checkpoint]

The model: a LLaMA of 512 wide, 8 layers, vocabulary 4,096 (random, made here), loaded as
float32, with int8 (W8A16), w8a8 (int8 activations too) and fp8 weights quantized on load
(``quantization=``), with an int8 KV cache
(``kv_cache_dtype="int8"``, float32 weights), and as a
compressed-tensors W4A16 checkpoint (group 128, LM head float) made here from the same float
weights (needs the test extra: torch and compressed-tensors). Prints the bytes of the arrays
the engine holds for the weights (all of them, and the layers' alone), their ratio to the same
model in float16, and decode tokens/s at each batch size (greedy, 16-token prompts; the fastest of ``--repeats``
warm calls, the formats interleaved), with each one's ratio to float32.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import bench_common  # noqa: F401  (puts this checkout on the path)
from paged_jax import LLM, SamplingParams
from paged_jax.models.tiny import make_tiny_model


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def decode_seconds(llm, batch: int, tokens: int) -> float:
    """Seconds for ``batch`` greedy requests of ``tokens`` output tokens each (a warm call)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=16).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="warm calls per cell, the fastest kept")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the W4A16 checkpoint (no torch needed)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "float", family="llama", vocab_size=4096, hidden_size=512,
                                    intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                                    num_key_value_heads=8))
        runs = {"float32": (model, None, "auto"), "int8": (model, "int8", "auto"), "w8a8": (model, "w8a8", "auto"),
                "fp8": (model, "fp8", "auto"), "int8 KV": (model, None, "int8")}
        if not a.no_checkpoint:
            from tests.hf_models import quantize_ct

            runs["W4A16 g128"] = (str(quantize_ct(model, "W4A16", Path(tmp) / "w4a16", group_size=128)), None, "auto")
        # Every engine is built first (a small KV pool each), then the cells run interleaved: each
        # repeat times every weight format at one batch size before the next, so that a change in
        # the shared machine's load falls on all of them alike; the fastest repeat is kept.
        blocks = max(a.batches) * (16 + a.tokens) // 16 + 8
        engines, rows = {}, {}
        for name, (path, quantization, kv_cache_dtype) in runs.items():
            llm = LLM(path, quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_model_len=256,
                      num_kv_blocks=blocks)
            params = llm.llm_engine.runner.params
            rows[name] = dict(all=nbytes(params), layers=nbytes(params["layers"]), rates={})
            engines[name] = llm
            for b in a.batches:
                decode_seconds(llm, b, a.tokens)  # compiles the shapes the cell reaches
        for b in a.batches:
            best = dict.fromkeys(engines, float("inf"))
            for _ in range(a.repeats):
                for name, llm in engines.items():
                    best[name] = min(best[name], decode_seconds(llm, b, a.tokens))
            for name in engines:
                rows[name]["rates"][b] = b * a.tokens / best[name]
        n_params, n_layer_params = rows["float32"]["all"] // 4, rows["float32"]["layers"] // 4
        fp16_all, fp16_layers = 2 * n_params, 2 * n_layer_params
        print(f"{model}: {n_params / 1e6:.1f} M parameters, {n_layer_params / 1e6:.1f} M in the layers")
        print(f"{'weights':11s} {'all bytes':>12s} {'/ float16':>10s} {'layer bytes':>12s} {'/ float16':>10s}  "
              + "  ".join(f"batch {b} tok/s (/ f32)" for b in a.batches))
        base = rows["float32"]["rates"]
        for name, r in rows.items():
            print(f"{name:11s} {r['all']:12,d} {r['all'] / fp16_all:10.3f} {r['layers']:12,d} "
                  f"{r['layers'] / fp16_layers:10.3f}  "
                  + "  ".join(f"{r['rates'][b]:13.1f} ({r['rates'][b] / base[b]:4.2f}x)" for b in a.batches))


if __name__ == "__main__":
    main()
