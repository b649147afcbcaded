"""What int8 weights (``quantization="int8"``, quantized on load) hold and how fast they decode,
side by side with the float model in one run.

    python experiments/bench_quantized.py [--model DIR] [--batches 1 8] [--tokens 64]

Default model: a LLaMA of 512 wide, 8 layers, vocabulary 4,096 (random, made here). Prints the bytes
of the arrays the engine holds for the weights (all of them, and the layers' alone), their ratio to the
same model in float16, and decode tokens/s at each batch size (greedy, a warm second call).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np

import bench_common  # noqa: F401  (puts this checkout on the path)
from paged_jax import LLM, SamplingParams
from paged_jax.models.tiny import make_tiny_model


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def decode_rate(llm, batch: int, tokens: int) -> float:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=16).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # compiles
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return batch * tokens / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or str(make_tiny_model(tmp, family="llama", vocab_size=4096, hidden_size=512,
                                               intermediate_size=1408, num_hidden_layers=8,
                                               num_attention_heads=8, num_key_value_heads=8))
        rows = {}
        for q in (None, "int8"):
            llm = LLM(model, quantization=q, max_model_len=256)
            params = llm.llm_engine.runner.params
            rows[q] = dict(all=nbytes(params), layers=nbytes(params["layers"]),
                           rates={b: decode_rate(llm, b, a.tokens) for b in a.batches})
            del llm
        n_params = rows[None]["all"] // 4  # the float model is float32
        n_layer_params = rows[None]["layers"] // 4
        fp16_all, fp16_layers = 2 * n_params, 2 * n_layer_params
        print(f"{model}: {n_params / 1e6:.1f} M parameters, {n_layer_params / 1e6:.1f} M in the layers")
        print(f"{'weights':8s} {'all bytes':>12s} {'/ float16':>10s} {'layer bytes':>12s} {'/ float16':>10s}  "
              + "  ".join(f"batch {b} tok/s" for b in a.batches))
        for q, r in rows.items():
            print(f"{q or 'float32':8s} {r['all']:12,d} {r['all'] / fp16_all:10.2f} {r['layers']:12,d} "
                  f"{r['layers'] / fp16_layers:10.2f}  " + "  ".join(f"{r['rates'][b]:13.1f}" for b in a.batches))
        print("int8 / float32 tokens/s: " + ", ".join(
            f"batch {b} {rows['int8']['rates'][b] / rows[None]['rates'][b]:.2f}x" for b in a.batches))


if __name__ == "__main__":
    main()
