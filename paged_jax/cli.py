"""``paged-jax`` command line: ``generate`` (the main job), ``serve`` (OpenAI-compatible server),
``convert`` and ``make-tiny``."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from paged_jax import envs
from paged_jax.policy import POLICIES

# The default model was trained on the Python standard library's source: code prompts suit it.
DEMO_PROMPTS = [
    "def __init__(self, ", "import os\nimport sys\n", "class ParseError(Exception):\n    \"\"\"",
    "    def __repr__(self):\n        return ", "for i in range(", "if __name__ == '__main__':\n    ",
    "        raise ValueError(", "def read_file(path):\n    with open(", "try:\n    import ",
    "    @property\n    def name(self):\n        ", "def is_valid(value):\n    \"\"\"Return True if",
    "        self.", "    def close(self):\n", "def join(a, *p):\n", "        if not isinstance(",
    "    # ", "    except KeyError:\n        ", "def main():\n    parser = ", "    return ''.join(",
    "__all__ = [",
]


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder (default: the bundled model, trained on the Python standard library)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts into chunks beside the running decodes (default; --no-enable-chunked-prefill: a prompt runs whole in one step, the paper's mode)")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--scheduling-policy", default=None, choices=list(POLICIES),
                   help="fcfs (vLLM's; the default without --target-itl-ms), short-first (prompts with the fewest "
                        "tokens left first, with aging; the default with it), or one of the paper's baselines: Orca "
                        "reserving max_model_len, the prompt plus a power of two or the true output length; "
                        "FasterTransformer (static batches)")
    p.add_argument("--target-itl-ms", type=float, default=None,
                   help="milliseconds between tokens that running streams should see while prompts prefill: "
                        "each step's prefill chunks are sized to a step-cost model fitted online "
                        "(default: a fixed token budget per step)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help="speculative decoding, vLLM's dict as JSON, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (default: off)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps per engine step where every running request decodes greedily and none "
                        "waits: k > 1 runs k of them in one call, the engine's own work paid once (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices to split the model over (Megatron-style tensor parallelism)")
    p.add_argument("--warm-up", action="store_true", help="compile every reachable step shape before serving")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8", "fp8"],
                   help="the KV cache's dtype: the model's (auto), bfloat16 (half a float32 model's bytes), or 8 bits "
                        "with a scale per token and head (int8, fp8): more blocks in the same memory")
    p.add_argument("--quantization", default=None, choices=["int8", "w8a8", "fp8", "int4", "int4-g128"],
                   help="quantize the layers' linear weights as they load (per output channel; w8a8: int8 "
                        "activations per token too; int4: 4 bits per group of 32 rows, int4-g128 of 128); "
                        "a quantized checkpoint needs no flag")
    p.add_argument("--native-kernels", action=argparse.BooleanOptionalAction, default=None,
                   help="the native CPU kernels (default: on where they build, unless PAGED_JAX_NATIVE=0)")
    p.add_argument("--compile-cache-dir", default=None,
                   help="folder of JAX's compilation cache and the compiled steps (default: PAGED_JAX_COMPILE_CACHE "
                        "or ~/.cache/paged_jax/jax_cache)")


def _speculative_config(text: str) -> dict:
    """--speculative-config: a JSON object, checked as ``LLM(speculative_config=...)`` checks it (argparse
    reports a bad one with the option's name instead of a traceback)."""
    import json

    from paged_jax.spec_decode import SpeculativeConfig

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"method\": \"ngram\", "
                                         f"\"num_speculative_tokens\": 4}}', got {text!r}")
    try:
        SpeculativeConfig.from_dict(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _llm(a):
    from paged_jax import LLM

    return LLM(model=a.model, dtype=a.dtype, block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
               max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, preemption_mode=a.preemption_mode,
               enable_chunked_prefill=a.enable_chunked_prefill, enable_prefix_caching=a.enable_prefix_caching,
               attention_backend=a.attention_backend, seed=a.seed, tensor_parallel_size=a.tensor_parallel_size,
               warm_up=getattr(a, "warm_up", False), quantization=a.quantization,
               kv_cache_dtype=a.kv_cache_dtype, scheduling_policy=a.scheduling_policy,
               target_itl_ms=a.target_itl_ms, native_kernels=a.native_kernels,
               compile_cache_dir=a.compile_cache_dir, speculative_config=a.speculative_config,
               num_scheduler_steps=a.num_scheduler_steps)


def cmd_generate(a) -> int:
    from paged_jax import SamplingParams

    prompts = a.prompt or DEMO_PROMPTS
    llm = _llm(a)
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.sampling_seed)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for o in outputs:
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    stats = llm.llm_engine.get_stats()
    print(f"\n{len(outputs)} requests in {dt:.2f} s (compilation included): {len(outputs) / dt:.2f} requests/s, "
          f"{n_out / dt:.1f} generated tokens/s, {(n_in + n_out) / dt:.1f} total tokens/s; "
          f"{stats['num_compilations']} compilations, {stats['num_preemptions']} preemptions")
    sd = stats["spec_decode"]
    if sd is not None and sd["num_drafts"]:
        print(f"speculative decoding: {sd['num_accepted_tokens']} of {sd['num_draft_tokens']} draft tokens accepted "
              f"({sd['acceptance_rate']:.2f}), {sd['mean_acceptance_length']:.2f} tokens per verified step")
    return 0


def cmd_serve(a) -> int:
    import os

    from paged_jax.server.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES, run_server

    template = a.chat_template
    if template and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    body_limit = DEFAULT_MAX_REQUEST_BODY_BYTES if a.max_request_body_bytes is None else a.max_request_body_bytes
    # Non-zero when the engine died (a failed device step): a supervisor should restart the server.
    return run_server(_llm(a).llm_engine, host=a.host, port=a.port,
                      api_key=a.api_key or envs.api_key(),
                      served_model_name=a.served_model_name, chat_template=template, log_level=a.log_level,
                      access_log=not a.disable_uvicorn_access_log, max_request_body_bytes=body_limit)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (``make-tiny``'s options are parsed by ``paged_jax.models.tiny``)."""
    ap = argparse.ArgumentParser(prog="paged-jax", description="PagedAttention / vLLM-style serving in JAX")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate completions for a batch of prompts (offline, like LLM.generate)")
    _engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: 20 demo prompts")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("-v", "--verbose", action="store_true")
    c = sub.add_parser("convert", help="write a HF model folder as an orbax checkpoint that loads sharded")
    c.add_argument("--model", required=True, help="HF model folder (config.json + safetensors + tokenizer)")
    c.add_argument("--out", required=True, help="new folder for the checkpoint (use it as --model later)")
    c.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    s = sub.add_parser("serve", help="serve the model with the OpenAI API (completions, chat, streaming)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 "
                   "(default: $PAGED_JAX_API_KEY, else no key)")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--chat-template", default=None, help="Jinja chat template (text or file) if the tokenizer has none")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    s.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default: 4 MiB)")
    # make-tiny's options belong to paged_jax.models.tiny, which parses (and documents, --help) them.
    sub.add_parser("make-tiny", add_help=False,
                   help="write a tiny random HF model folder (any model family, --family) offline; --help for options")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a, rest = ap.parse_known_args(argv)
    if a.cmd == "make-tiny":
        from paged_jax.models.tiny import main as tiny_main

        tiny_main(rest)
        return 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.cmd == "convert":
        from paged_jax.parallel.checkpoint import convert

        print(f"wrote {convert(a.model, a.out, a.dtype)}")
        return 0
    logging.basicConfig(level=logging.INFO if getattr(a, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(message)s")
    if a.cmd == "serve":
        return cmd_serve(a)
    return cmd_generate(a)


if __name__ == "__main__":
    sys.exit(main())
