"""Online serving benchmark, like vLLM's ``benchmarks/benchmark_serving.py``.

Sends ``--num-prompts`` streaming completion requests to an OpenAI-compatible
server with Poisson arrivals at ``--request-rate`` requests/s (``inf``: all at
once), at most ``--max-concurrency`` in flight, and prints request throughput,
output tokens/s and mean / median / p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, between
streamed chunks) and end-to-end latency (E2EL).

Prompts are random token ids (``--input-len`` of them, drawn with the model's
tokenizer when ``--tokenizer`` or ``--start-server`` gives one) or, without a
tokenizer, random words; ``ignore_eos`` makes every request generate exactly
``--output-len`` tokens.

    # against a running server
    python experiments/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 8 --num-prompts 200
    # start one (bundled tiny model unless --start-server DIR) and benchmark it
    python experiments/bench_serving.py --start-server default --server-args "--num-kv-blocks 2048" \
        --request-rate inf --max-concurrency 32 --num-prompts 128

Needs ``httpx`` (in the ``test`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import numpy as np

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or "
         "has had one their not but new first after who they have two been its all year more time").split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


async def one_request(http: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Result:
    res = Result()
    t0 = time.perf_counter()
    last = t0
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"]["message"]
                    return res
                now = time.perf_counter()
                if event.get("choices") and (event["choices"][0].get("text") or
                                             event["choices"][0].get("finish_reason")):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if event.get("usage"):
                    res.prompt_len = event["usage"]["prompt_tokens"]
                    res.output_len = event["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - t0
        res.ok = res.output_len > 0
        if not res.ok:
            res.error = "no usage in the stream"
    except Exception as exc:  # noqa: BLE001 - a benchmark reports failures, it does not stop
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def make_prompts(args, rng: np.random.Generator) -> list:
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        special = set(tok.all_special_ids)
        vocab = np.array([i for i in range(len(tok)) if i not in special])
        return [rng.choice(vocab, size=args.input_len).tolist() for _ in range(args.num_prompts)]
    return [" ".join(rng.choice(WORDS, size=args.input_len)) for _ in range(args.num_prompts)]


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = np.random.default_rng(args.seed)
    prompts = make_prompts(args, rng)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as http:
        model = args.model or (await http.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        def body(prompt):
            return {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        async def limited(prompt):
            if sem is None:
                return await one_request(http, args.endpoint, body(prompt), headers)
            async with sem:
                return await one_request(http, args.endpoint, body(prompt), headers)

        if args.warmup:  # compile the common shapes before timing
            await asyncio.gather(*[one_request(http, args.endpoint, body(p), headers) for p in prompts[:args.warmup]])
        tasks = []
        t0 = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration, args)


def summarize(results: list[Result], duration: float, args) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: np.asarray(xs, dtype=float) * 1000.0  # noqa: E731
    ttft = ms([r.ttft for r in ok])
    tpot = ms([(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1])
    itl = ms([x for r in ok for x in r.itl])
    e2el = ms([r.latency for r in ok])
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    stats = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
             "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
             "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
             "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
             "total_token_throughput": (in_tokens + out_tokens) / duration}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        for stat, fn in (("mean", np.mean), ("median", np.median), ("p99", lambda a: np.percentile(a, 99))):
            stats[f"{stat}_{name}_ms"] = float(fn(xs)) if len(xs) else float("nan")
    stats["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return stats


def print_report(s: dict) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Request rate (req/s):", s["request_rate"]), ("Max concurrency:", s["max_concurrency"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"), ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value!s:>20}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{' ' + title + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            print(f"{stat.capitalize() + ' ' + name.upper() + ' (ms):':<40}{s[f'{stat}_{name}_ms']:>20.2f}")
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")
    print("=" * 60)


def start_server(model: str, extra: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "paged_jax.cli", "serve", "--port", str(port), "--log-level", "warning",
           *([] if model == "default" else ["--model", model]), *shlex.split(extra)]
    proc = subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("server did not start in 300 s")


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="served model name (default: the server's first)")
    ap.add_argument("--api-key", default=os.environ.get("PAGED_JAX_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: burst)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for random token-id prompts")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent (and not timed) before the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--start-server", default=None, metavar="MODEL_DIR",
                    help="start `paged-jax serve` on a free loopback port ('default': the bundled tiny model)")
    ap.add_argument("--server-args", default="", help="extra arguments for the started server")
    ap.add_argument("--save-result", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    proc = None
    if args.start_server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args.base_url = f"http://127.0.0.1:{port}"
        if args.tokenizer is None:
            from paged_jax.models.tiny import default_model_path

            args.tokenizer = str(default_model_path()) if args.start_server == "default" else args.start_server
        proc = start_server(args.start_server, args.server_args, port)
    try:
        stats = asyncio.run(run(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print_report(stats)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(stats, f, indent=2)
    return stats


if __name__ == "__main__":
    main()
