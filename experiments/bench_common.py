"""Shared parts of the throughput and latency benchmarks: the model, the requests, the
two backends (paged-jax and Hugging Face transformers on torch) and the report.

Both backends get the same model folder and the same requests: prompt token ids
(random, seeded) and a fixed output length per request (EOS ignored:
``SamplingParams(max_tokens=L, ignore_eos=True)``; Hugging Face
``min_new_tokens = max_new_tokens = L``). Greedy by default on both; ``--temperature``
samples (top-p 1.0, no top-k, as vLLM's benchmark with 1.0); beam search: beams of width ``n``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import this checkout's paged_jax and experiments
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GPT2_124M = dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)
PAPER_MAX_TOTAL = 2048  # the paper's traces keep input + output < 2048


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


def gpt2_124m_model(path: Optional[str] = None) -> str:
    """A GPT-2-124M-shaped model (random weights, float32, the locally trained tokenizer,
    vocabulary 50257), built once into ``path`` (default: the paged-jax cache)."""
    from paged_jax.models.tiny import make_tiny_model

    from paged_jax import envs

    root = envs.home()
    out = Path(path) if path else root / "models" / "gpt2-124m-shaped"
    if not (out / "model.safetensors").is_file():
        import json

        from safetensors.numpy import load_file, save_file

        print(f"building a GPT-2-124M-shaped random model in {out} ...", file=sys.stderr)
        shape = {k: v for k, v in GPT2_124M.items() if k != "vocab_size"}
        make_tiny_model(out, family="gpt2", seed=0, **shape)
        # make_tiny_model sizes the vocabulary by its tokenizer (a few hundred tokens from the
        # bundled corpus); widen the embedding to GPT-2's 50257 rows (ids past the tokenizer's
        # decode to nothing).
        cfg = json.loads((out / "config.json").read_text())
        tensors = load_file(str(out / "model.safetensors"))
        wte = tensors["transformer.wte.weight"]
        extra = np.random.default_rng(1).standard_normal((GPT2_124M["vocab_size"] - wte.shape[0], wte.shape[1]))
        tensors["transformer.wte.weight"] = np.concatenate([wte, 0.08 * extra.astype(np.float32)])
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg["vocab_size"] = GPT2_124M["vocab_size"]
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return str(out)


def add_request_args(ap) -> None:
    ap.add_argument("--backend", choices=["paged-jax", "hf"], default="paged-jax")
    ap.add_argument("--model", default=None, help="model folder (default: a GPT-2-124M-shaped random model)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--dataset", default=None, choices=["sharegpt", "sharegpt-like", "alpaca", "alpaca-like"],
                    help="lengths from the paper's datasets (experiments/workloads.py); else --input-len/--output-len")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--max-total-len", type=int, default=512,
                    help="dataset lengths are scaled by max_total_len / 2048 (the paper's limit)")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (beam width with --use-beam-search)")
    ap.add_argument("--use-beam-search", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy on both backends (default; Hugging Face's multinomial sampling over 50257 "
                         "tokens costs more than its forward pass on the CPU); vLLM's benchmark uses 1.0")
    ap.add_argument("--hf-max-batch-size", type=int, default=None,
                    help="hf backend: static batches of up to this many requests (default: one at a time)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-warm-up", action="store_true", help="paged-jax: compile on first use instead")
    ap.add_argument("--attention-backend", default="auto",
                    help="paged-jax: 'auto' (Pallas on a GPU, native on a CPU), 'reference', 'native', 'pallas', ...")
    ap.add_argument("--dtype", default="auto", help="paged-jax: the model's dtype (auto: the checkpoint's)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="paged-jax: decode steps per engine step (multi-step decoding; default 1)")
    ap.add_argument("--enable-chunked-prefill", choices=["default", "on", "off"], default="default",
                    help="paged-jax: chunked prefill as the engine's default (on), on, or off (the paper's mode)")


def make_requests(a, vocab_size: int) -> list[Request]:
    if a.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {a.num_prompts}")
    if a.dataset:
        if a.input_len is not None or a.output_len is not None:
            raise ValueError("give either --dataset or --input-len/--output-len, not both")
        from experiments.workloads import sample_lengths

        ins, outs = sample_lengths(a.dataset.replace("-like", ""), a.num_prompts, a.seed)
        scale = a.max_total_len / PAPER_MAX_TOTAL
        ins = np.maximum(1, np.rint(ins * scale)).astype(int)
        outs = np.maximum(1, np.rint(outs * scale)).astype(int)
        ins = np.minimum(ins, a.max_total_len - 1)
        outs = np.minimum(outs, a.max_total_len - ins)
    else:
        if a.input_len is None or a.output_len is None:
            raise ValueError("give --dataset sharegpt|alpaca or both --input-len and --output-len")
        if a.input_len < 1 or a.output_len < 1:
            raise ValueError(f"--input-len and --output-len must be >= 1, got {a.input_len}, {a.output_len}")
        ins = np.full(a.num_prompts, a.input_len)
        outs = np.full(a.num_prompts, a.output_len)
    rng = np.random.default_rng(a.seed)
    return [Request(rng.integers(0, vocab_size, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def sampling_params(a, output_len: int):
    from paged_jax import SamplingParams

    if a.use_beam_search:
        return SamplingParams(n=a.n, best_of=a.n, use_beam_search=True, temperature=0.0, max_tokens=output_len,
                              ignore_eos=True)
    if a.n > 1 and a.temperature == 0:
        raise ValueError(f"--n {a.n} needs sampling: give --temperature > 0 (or --use-beam-search)")
    return SamplingParams(n=a.n, temperature=a.temperature, top_p=1.0, max_tokens=output_len, ignore_eos=True)


# ---- paged-jax ---------------------------------------------------------------
def make_llm(a, model: str, max_model_len: int, max_num_seqs: Optional[int] = None, warm_up: bool = True,
             chunked: Optional[str] = None):
    from paged_jax import LLM

    chunked = chunked or getattr(a, "enable_chunked_prefill", "default")
    kw = {} if chunked == "default" else dict(enable_chunked_prefill=chunked == "on")
    llm = LLM(model, max_num_seqs=max_num_seqs or a.max_num_seqs, max_model_len=max_model_len,
              block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
              max_num_batched_tokens=a.max_num_batched_tokens, seed=a.seed,
              attention_backend=getattr(a, "attention_backend", "auto"), dtype=getattr(a, "dtype", "auto"),
              num_scheduler_steps=getattr(a, "num_scheduler_steps", 1), **kw)
    if warm_up:
        t = time.perf_counter()
        n = llm.llm_engine.warm_up(sampling_params(a, 1))
        cache = llm.llm_engine.runner.executable_cache
        on_disk = f", {cache.loaded} loaded from the compile cache" if cache is not None else ""
        print(f"warm-up: {n} step shapes compiled in {time.perf_counter() - t:.1f} s "
              f"({llm.llm_engine.get_stats()['num_compilations']} compilations in all{on_disk})", file=sys.stderr)
    return llm


def run_paged_jax(llm, a, requests: list[Request]) -> dict:
    """All requests submitted at once; returns elapsed seconds, per-request latencies and engine stats."""
    engine = llm.llm_engine
    before = engine.get_stats()
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(f"bench-{id(requests)}-{i}", None, sampling_params(a, r.output_len),
                           prompt_token_ids=r.prompt_token_ids)
    latencies = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    after = engine.get_stats()
    return {"elapsed": elapsed, "latencies": latencies, "steps": after["num_steps"] - before["num_steps"],
            "new_compilations": after["num_compilations"] - before["num_compilations"],
            "timings": {k: after["timings"][k] - before["timings"].get(k, 0.0) for k in after["timings"]}}


# ---- Hugging Face ------------------------------------------------------------
def profiler_events(run) -> list[dict]:
    """Every event ``jax.profiler`` records while ``run()`` runs (its Perfetto trace's ``traceEvents``)."""
    import gzip

    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            run()
        return json.loads(gzip.open(next(Path(d).rglob("*.trace.json.gz"))).read())["traceEvents"]


def load_hf(model: str, dtype: str = "auto"):
    """The Hugging Face model on torch's GPU where it has one (the paper's baseline runs there), else
    on the CPU; ``dtype`` as paged-jax's ``--dtype`` ("auto": float32, what paged-jax gives a random
    float32 checkpoint), so both engines run the same precision."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:  # torch is a test-only dependency
        raise SystemExit(f"the hf backend needs torch: pip install torch==2.13.0 ({e})")
    torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    if torch.cuda.is_available():
        m = m.to("cuda")
    m.eval()
    return m


def run_hf(model, a, requests: list[Request], batch_size: int = 1) -> dict:
    """``generate`` over static batches of ``batch_size`` requests in order (left padding; a
    batch runs to its longest output). Returns elapsed seconds and per-request latencies."""
    import torch

    pad = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    latencies = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(requests), batch_size):
            batch = requests[s:s + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[i, width - len(r.prompt_token_ids):] = 1
            out_len = max(r.output_len for r in batch)
            if a.use_beam_search:
                kw = dict(num_beams=a.n, do_sample=False, num_return_sequences=a.n)
            elif a.temperature == 0:
                kw = dict(do_sample=False)
            else:
                kw = dict(do_sample=True, temperature=a.temperature, top_p=1.0, top_k=0, num_return_sequences=a.n)
            ids, mask = ids.to(model.device), mask.to(model.device)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                           pad_token_id=pad, **kw)
            if ids.is_cuda:
                torch.cuda.synchronize()
            latencies += [time.perf_counter() - t0] * len(batch)
    return {"elapsed": time.perf_counter() - t0, "latencies": latencies}


# ---- report ------------------------------------------------------------------
def summarize(requests: list[Request], result: dict, n: int = 1) -> dict:
    el = result["elapsed"]
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.output_len for r in requests) * n
    lat = np.array(result["latencies"])
    return {"requests_per_s": len(requests) / el, "tokens_per_s": (prompt + output) / el,
            "output_tokens_per_s": output / el, "elapsed_s": el,
            "p50_s": float(np.percentile(lat, 50)), "p90_s": float(np.percentile(lat, 90)),
            "p99_s": float(np.percentile(lat, 99))}


def format_summary(name: str, s: dict) -> str:
    return (f"{name}: {s['requests_per_s']:.3f} requests/s, {s['tokens_per_s']:.1f} tokens/s "
            f"({s['output_tokens_per_s']:.1f} output tokens/s), {s['elapsed_s']:.1f} s; "
            f"latency p50 {s['p50_s']:.2f} s, p90 {s['p90_s']:.2f} s, p99 {s['p99_s']:.2f} s")


def describe_requests(requests: list[Request]) -> str:
    ins = np.array([len(r.prompt_token_ids) for r in requests])
    outs = np.array([r.output_len for r in requests])
    return (f"{len(requests)} requests: input mean {ins.mean():.1f} (max {ins.max()}), output mean {outs.mean():.1f} "
            f"(max {outs.max()}), longest total {int((ins + outs).max())}")


def max_len(requests: list[Request]) -> int:
    return max(len(r.prompt_token_ids) + r.output_len for r in requests)


def engine_max_len(a, requests: list[Request]) -> int:
    """The engine's max_model_len for ``requests``: with a dataset, at least ``--max-total-len``. Every
    script running the same workload must size it so: it bounds the KV pool, whose shape is part of
    each compiled step's key, so another value compiles every step again instead of loading it."""
    return max(max_len(requests), a.max_total_len if a.dataset else 0)


# ---- side by side with an earlier revision -------------------------------------
@contextlib.contextmanager
def revision_checkout(rev: Optional[str]):
    """A temporary git worktree of this repository at ``rev`` (its path), removed afterwards;
    ``None``: no checkout (yields None)."""
    if rev is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", path, rev], check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", path], capture_output=True)


def child_result(cmd: list[str], what: str, env: Optional[dict] = None) -> dict:
    """Run a benchmark's child process and return the JSON of its ``RESULT`` line (RuntimeError with
    the end of its stderr when it fails)."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT "):])
