"""Perplexity of a model folder on held-out text, through the engine's ``prompt_logprobs``,
checked against transformers' own loss on the same token windows.

    python experiments/eval_perplexity.py                      # the bundled default model
    python experiments/eval_perplexity.py --model /path/to/hf-folder --windows 32
    python experiments/eval_perplexity.py --quantization int8 fp8 --kv-cache-dtype int8 fp8

The text is the standard library files held out from the default model's training
(``stdlib_corpus.py``), tokenized with the model's tokenizer, cut into windows of
``--window`` tokens (each a prompt). Perplexity = exp(mean negative log-likelihood of every
window token after the first). The engine's figure and transformers' are printed side by side
with their ratio; the script exits non-zero if they differ by more than ``--rtol``. With
``--quantization`` / ``--kv-cache-dtype``, each method's perplexity (weights quantized on load,
or an 8-bit KV cache) is printed beside the float one's instead.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stdlib_corpus  # noqa: E402


def token_windows(tokenizer, window: int, count: int) -> list[list[int]]:
    """``count`` windows of ``window`` tokens, spread evenly over the held-out files' tokens."""
    _, held = stdlib_corpus.split()
    stream = []
    for f in held:
        stream.extend(tokenizer(stdlib_corpus.read(f)).input_ids)
    starts = np.linspace(0, len(stream) - window, count).astype(int)
    return [stream[s:s + window] for s in starts]


def engine_nll(model: str, windows: list[list[int]], dtype: str, **engine_options) -> tuple[float, int]:
    """Summed negative log-likelihood and token count from the engine's prompt logprobs
    (``engine_options``: e.g. ``quantization="int8"``, ``kv_cache_dtype="int8"``)."""
    from paged_jax import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=max(len(w) for w in windows) + 1, **engine_options)
    outs = llm.generate(prompt_token_ids=windows, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))
    nll, n = 0.0, 0
    for w, out in zip(windows, outs):
        for tok, entry in zip(w[1:], out.prompt_logprobs[1:]):
            nll -= entry[tok]
            n += 1
    return nll, n


def hf_nll(model: str, windows: list[list[int]]) -> tuple[float, int]:
    """The same from transformers' loss (mean over each window's predicted tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            nll += float(hf(ids, labels=ids).loss) * (len(w) - 1)
            n += len(w) - 1
    return nll, n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the bundled default model)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers check")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--quantization", nargs="*", default=[], help="compare these on-load methods (int8, w8a8, fp8)")
    ap.add_argument("--kv-cache-dtype", nargs="*", default=[], help="compare these KV cache dtypes (bfloat16, int8, fp8)")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from paged_jax.models.tiny import default_model_path

    model = a.model or str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    windows = token_windows(tokenizer, a.window, a.windows)
    print(f"{model}: {len(windows)} windows of {a.window} tokens from {stdlib_corpus.describe()}")
    nll, n = engine_nll(model, windows, a.dtype)
    ppl = math.exp(nll / n)
    print(f"paged-jax    perplexity {ppl:10.3f}  ({n} tokens; vocabulary {tokenizer.vocab_size}, "
          f"ratio to the vocabulary {ppl / len(tokenizer):.4f})")
    variants = [(f"{m} weights", dict(quantization=m)) for m in a.quantization]
    variants += [(f"{d} KV cache", dict(kv_cache_dtype=d)) for d in a.kv_cache_dtype]
    for name, options in variants:
        q_nll, q_n = engine_nll(model, windows, a.dtype, **options)
        q_ppl = math.exp(q_nll / q_n)
        print(f"{name:15s} perplexity {q_ppl:10.3f}  (/ float = {q_ppl / ppl:.4f})")
    if a.no_hf or variants:
        return
    hf_total, hf_n = hf_nll(model, windows)
    hf_ppl = math.exp(hf_total / hf_n)
    print(f"transformers perplexity {hf_ppl:10.3f}  (paged-jax / transformers = {ppl / hf_ppl:.6f})")
    if abs(ppl / hf_ppl - 1) > a.rtol:
        sys.exit(f"perplexities differ by more than rtol={a.rtol}")


if __name__ == "__main__":
    main()
