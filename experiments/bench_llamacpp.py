"""paged-jax against llama.cpp on this CPU, side by side in one run: batch-1 decode (llama-bench) and
48 requests at once (llama-server with continuous batching), float32, 8-bit and 4-bit weights.

    python experiments/bench_llamacpp.py [--rounds 3] [--isa native|avx2] [--llama-threads 2] [--cache DIR]
                                         [--batch-1-only] [--num-scheduler-steps 1 8] [--temperature 0]
                                         [--formats float32 8-bit 4-bit "8-bit w8a8"] [--cache-type-kv f16|f32]
                                         [--kv-cache-dtype auto bfloat16 ...]
                                         [--max-num-batched-tokens N]

llama.cpp's tools are built once from the llama-cpp-python source distribution on PyPI
(``pip download --no-binary``; CMake, ``-DGGML_NATIVE=ON``, only llama-bench, llama-server and
llama-quantize; about 15 minutes on 2 cores) into ``--cache`` (default
``~/.cache/paged-jax/llamacpp``), outside the repository. ``--isa avx2`` builds llama.cpp with
AVX2 + FMA and without AVX-512 (``-DGGML_NATIVE=OFF``), and holds paged-jax to the same
(``PAGED_JAX_NATIVE_FLAGS=-mno-avx512f``, ``--xla_cpu_max_isa=AVX2``): on an AVX-512 CPU that
is this CPU with AVX-512 turned off, not an AVX2 CPU.

The model: a LLaMA 512 wide, 8 layers, 8 heads, intermediate 1,408, random float32 weights, made
here (its vocabulary is what the bundled tokenizer learns from a 1,024 target, about 700 tokens),
converted to GGUF f32 and q8_0 with llama.cpp's own ``convert_hf_to_gguf.py`` and to q4_0 with
``llama-quantize``. paged-jax loads the same folder as float32, ``quantization="int8"`` and
``quantization="int4"`` (q4_0's rounding, groups of 32).

- Batch 1: ``llama-bench -p 0 -n 32 -d 88 -t 2`` (32 tokens generated after an 88-token context)
  against paged-jax's 32 greedy tokens after the first, after the same prompt length (timed from
  the engine step that returned the first token to the one that returned the last: the prompt's
  prefill left out on both sides; :func:`paged_jax_decode`).
- 48 requests: prompts of 16-160 random tokens (seeded), 64 tokens each, greedy, EOS ignored, all
  sent at once: ``llama-server -np 48 -cb -t 2`` (started per format, the clock runs from the
  first request to the last answer) against paged-jax's ``LLM.generate`` of the same prompts
  (its second call: compiling left out).

paged-jax runs once per ``--num-scheduler-steps`` value (default 1 and 8: one decode step per engine
step, and multi-step decoding, ``paged_jax.multi_step``), each its own column. ``--temperature T`` > 0:
paged-jax samples (unseeded, no top-k / top-p) and so do llama-server's requests (``top_k`` 0); llama-bench
samples nothing, so the batch-1 table then sets paged-jax's sampled decode against llama.cpp's bare one.

KV caches alike on both sides: llama.cpp keeps its KV cache in float16 unless told otherwise, and
paged-jax then runs ``kv_cache_dtype="bfloat16"`` (16 bits each, widened to float32 as the attention
reads them); ``--cache-type-kv f32`` gives llama-server a float32 cache (``-ctk f32 -ctv f32``) and
paged-jax the model's float32 (``"auto"``); llama-bench takes no float32 cache and keeps its f16.
``--kv-cache-dtype`` sets paged-jax's instead, one column each (``--kv-cache-dtype auto bfloat16``: both
caches side by side). ``--max-num-batched-tokens
N`` sets paged-jax's token budget per step (default: the engine's, ``max(max_num_seqs, 256)`` with chunked
prefill; llama-server's own default is a 2,048-token batch in micro-batches of 512). ``--formats`` runs a
subset of the three formats, or adds ``"8-bit w8a8"``: ``quantization="w8a8"`` (activations quantized
per token for integer dot products, as q8_0's are per 32) against the same q8_0.

Each of ``--rounds`` rounds runs every format on both engines in turn, each engine in fresh processes
(llama-bench and llama-server are started per round; paged-jax's cells of the format run in a child
process of their own, :func:`paged_jax_child`, its engines warmed up there untimed); the best round of each is
kept (and llama.cpp's best of ``--llama-threads``: on a machine shared with other work, its two
threads waiting on each other at every step can make ``-t 1`` the faster). Prints the tables with paged-jax's ratio over llama.cpp, the CPU and its instruction sets,
and how many of the 48 requests' greedy outputs are the same token for token (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
# paged-jax's kv_cache_dtype beside llama.cpp's cache type: 16 bits against 16 (llama.cpp's default f16
# beside bfloat16: the kernels widen either to float32 as they read it), float32 against float32
LIKE_CACHE_TYPE = {"f16": "bfloat16", "f32": "auto"}
TOOLS = ("llama-bench", "llama-server", "llama-quantize")
CMAKE_ISA = {"native": ["-DGGML_NATIVE=ON"],
             "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                      "-DGGML_AVX512=OFF", "-DGGML_BMI2=ON"]}
FORMATS = {"float32": ("f32", None), "8-bit": ("q8_0", "int8"), "4-bit": ("q4_0", "int4"),  # GGUF, paged-jax
           "8-bit w8a8": ("q8_0", "w8a8")}  # activations quantized too, as q8_0's dot products do (not by default)
DEFAULT_FORMATS = ["float32", "8-bit", "4-bit"]
MODEL = dict(family="llama", vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=8)
PROMPT, DECODE = 88, 32  # batch 1: context, tokens generated
REQUESTS, OUT_LEN, LENS = 48, 64, (16, 160)
# The converter picks the tokenizer by a hash of known models' pre-tokenizers and wants
# sentencepiece for LLaMA; the bundled tokenizer is a plain byte-level BPE (GPT-2's split).
CONVERT = """
import sys
sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]
import convert_hf_to_gguf
from conversion.base import TextModel
def no_file(self):
    raise FileNotFoundError
TextModel._set_vocab_sentencepiece = no_file
TextModel._set_vocab_llama_hf = no_file
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
convert_hf_to_gguf.main()
"""


def run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return res.stdout


def build_llama_cpp(cache: Path, isa: str) -> tuple[Path, Path]:
    """(llama.cpp's source folder, its bin folder), built once per ISA into ``cache``."""
    src = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    build = cache / f"build-{LLAMA_CPP_PYTHON}-{isa}"
    if all((build / "bin" / t).is_file() for t in TOOLS):
        return src, build / "bin"
    cache.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not sdist.is_file():
            print(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON}'s source distribution ...", file=sys.stderr)
            run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "--no-binary",
                 ":all:", "--no-deps", "-d", str(cache)])
        with tarfile.open(sdist) as t:
            t.extractall(cache, filter="data")
    print(f"building llama.cpp's {', '.join(TOOLS)} ({isa}) in {build}: about 15 minutes on 2 cores ...",
          file=sys.stderr)
    run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *CMAKE_ISA[isa],
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
         "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"])
    run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TOOLS])
    return src, build / "bin"


def make_ggufs(src: Path, bin_dir: Path, model: Path, out: Path) -> dict:
    """The model as GGUF, by format: f32 and q8_0 from the converter, q4_0 quantized from f32."""
    files = {f: out / f"model-{f}.gguf" for f in ("f32", "q8_0", "q4_0")}
    for f in ("f32", "q8_0"):
        run([sys.executable, "-c", CONVERT, str(src), str(src / "gguf-py"), str(model), "--outtype", f,
             "--outfile", str(files[f])])
    run([str(bin_dir / "llama-quantize"), str(files["f32"]), str(files["q4_0"]), "q4_0", "2"])
    return files


def llama_bench(bin_dir: Path, gguf: Path, threads: list) -> float:
    """llama-bench's decode tokens/s: 32 tokens after an 88-token context, the best of its thread counts."""
    out = run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(DECODE), "-d", str(PROMPT),
               "-t", ",".join(map(str, threads)), "-r", "3", "-o", "json"])
    return max(float(r["avg_ts"]) for r in json.loads(out))


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def llama_server(bin_dir: Path, gguf: Path, prompts: list, port: int, threads: int,
                 temperature: float = 0.0, cache_type: str = "f16") -> tuple[float, list]:
    """llama-server's output tokens/s for the requests all sent at once, and their tokens."""
    ctx = REQUESTS * (LENS[1] + OUT_LEN + 8)
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf), "-np", str(REQUESTS), "-cb", "-c",
                             str(ctx), "-t", str(threads), "-ctk", cache_type, "-ctv", cache_type, "--port", str(port),
                             "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None:
                    sys.exit(f"llama-server exited: {proc.stderr.read()[-3000:]}")
                time.sleep(0.2)
        sampling = dict(temperature=0, top_k=1) if temperature == 0 else dict(temperature=temperature, top_k=0, top_p=1.0,
                                                                              min_p=0.0)
        body = dict(n_predict=OUT_LEN, ignore_eos=True, cache_prompt=False, return_tokens=True, **sampling)
        post(url + "/completion", dict(body, prompt=prompts[0], n_predict=4))  # warm
        results: list = [None] * len(prompts)

        def one(i):
            results[i] = post(url + "/completion", dict(body, prompt=prompts[i]))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        made = sum(r["tokens_predicted"] for r in results)
        return made / elapsed, [r["tokens"] for r in results]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def paged_jax_decode(llm, prompt: list, temperature: float = 0.0) -> float:
    """Decode tokens/s at batch 1: the tokens after the first over the time from the step that
    returned the first to the step that returned the last (the streams' mean inter-token time, as
    llama-bench's tg times its tokens after the context), the best of three requests. (A request of
    1 + DECODE tokens less one of a single token, timed apart, let the noise of the second call
    through: a slow single-token call inflated the rate.)"""
    from paged_jax import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=temperature, max_tokens=1 + DECODE, ignore_eos=True)
    best = 0.0
    for i in range(3):
        engine.add_request(f"decode-{time.perf_counter_ns()}-{i}", None, params, prompt)
        before = engine.num_generated_tokens
        while engine.num_generated_tokens == before:  # the prompt's step(s) up to the first token
            engine.step()
        first, t0 = engine.num_generated_tokens, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        best = max(best, (engine.num_generated_tokens - first) / (time.perf_counter() - t0))
    return best


def paged_jax_batch(llm, prompts: list, temperature: float = 0.0) -> tuple[float, list]:
    from paged_jax import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=OUT_LEN, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def cpu() -> tuple[str, str]:
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line for line in info.splitlines() if line.startswith("flags")), "").split())
    isa = [f for f in ("sse4_2", "avx", "f16c", "fma", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                       "avx_vnni") if f in flags]
    return name, " ".join(isa)


def paged_jax_round(spec: dict) -> dict:
    """One round of one format's paged-jax cells, in this (fresh) process: its engines built and
    warmed up (compiling, untimed), then each variant's batch-1 decode and, unless ``batch_1_only``,
    its 48 requests. Returns ``{"rates": {cell: tokens/s}, "tokens": {column: tokens}, "paths": ...}``."""
    from paged_jax import LLM, native

    temp, engines = spec["temperature"], {}
    for k, kv in spec["variants"]:
        engines[k, kv] = LLM(spec["model"], quantization=spec["quantization"], max_model_len=512,
                             num_kv_blocks=spec["blocks"], max_num_seqs=REQUESTS, num_scheduler_steps=k,
                             kv_cache_dtype=kv, max_num_batched_tokens=spec["max_num_batched_tokens"])
        paged_jax_decode(engines[k, kv], spec["prompt"], temp)  # compiles what the cells reach
        if not spec["batch_1_only"]:
            paged_jax_batch(engines[k, kv], spec["prompts"], temp)
    rates, tokens = {}, {}
    for (k, kv), llm in engines.items():
        column = _column((k, kv))
        rates[f"{column}|decode"] = paged_jax_decode(llm, spec["prompt"], temp)
        if not spec["batch_1_only"]:
            rates[f"{column}|batch"], tokens[column] = paged_jax_batch(llm, spec["prompts"], temp)
    return {"rates": rates, "tokens": tokens, "paths": native.paths()}


def paged_jax_child(spec: dict) -> dict:
    """:func:`paged_jax_round` in a child process of its own: each round of paged-jax starts from a fresh
    process, as each of llama-bench's and llama-server's does. (One process for every round gave
    paged-jax one draw of what differs between processes, where llama.cpp had one a round: the same
    int4 decode measured 530-890 tokens/s as the best of five rounds in six processes on one machine,
    the rounds within a process closer together.)"""
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                     os.environ.get("PYTHONPATH")]))))
    if res.returncode:
        sys.exit(f"paged-jax's round failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # one round of paged-jax (paged_jax_child)
        sys.path.insert(0, str(ROOT))
        print(json.dumps(paged_jax_round(json.loads(argv[1]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isa", choices=list(CMAKE_ISA), default="native")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/paged-jax/llamacpp").expanduser())
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--llama-threads", type=int, nargs="+", default=[2],
                    help="llama.cpp's thread counts, the best kept (on a loaded machine -t 1 can beat -t 2)")
    ap.add_argument("--build-only", action="store_true", help="build llama.cpp's tools and stop")
    ap.add_argument("--batch-1-only", action="store_true", help="only the batch-1 decode table (no 48 requests)")
    ap.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1, 8],
                    help="paged-jax's decode steps per engine step, a column each (default: 1 and 8)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: paged-jax and llama-server sample (default 0: greedy)")
    ap.add_argument("--formats", nargs="+", default=DEFAULT_FORMATS, choices=list(FORMATS),
                    help="the weight formats, a table row each (default: float32 8-bit 4-bit; '8-bit w8a8': "
                         "quantization='w8a8' against q8_0)")
    ap.add_argument("--cache-type-kv", default="f16", choices=["f16", "f32"],
                    help="llama-server's KV cache type (default f16, its own default; llama-bench keeps f16)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=None, choices=["auto", "bfloat16", "int8", "fp8"],
                    help="paged-jax's kv_cache_dtype, a column each (default: the like of --cache-type-kv: bfloat16 "
                         "for f16, auto (the model's float32) for f32)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="paged-jax's token budget per step (default: the engine's)")
    a = ap.parse_args(argv)
    if a.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {a.temperature}")
    temp, ctype = a.temperature, a.cache_type_kv
    kvs = a.kv_cache_dtype or [LIKE_CACHE_TYPE[ctype]]
    formats = {n: FORMATS[n] for n in FORMATS if n in a.formats}
    if a.isa == "avx2" and os.environ.get("PAGED_JAX_NATIVE_FLAGS") is None:  # hold paged-jax to AVX2 too: re-run
        env = dict(os.environ, PAGED_JAX_NATIVE_FLAGS="-mno-avx512f",
                   XLA_FLAGS=" ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_cpu_max_isa=AVX2"])))
        sys.exit(subprocess.call([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env))
    src, bin_dir = build_llama_cpp(a.cache, a.isa)
    if a.build_only:
        print(bin_dir)
        return
    sys.path.insert(0, str(ROOT))
    from paged_jax.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(make_tiny_model(Path(tmp) / "model", **MODEL))
        ggufs = make_ggufs(src, bin_dir, model, Path(tmp))
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        rng = np.random.default_rng(0)
        prompt = rng.integers(3, vocab, PROMPT).tolist()
        prompts = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(LENS[0], LENS[1] + 1, REQUESTS)]
        variants = [(k, kv) for k in a.num_scheduler_steps for kv in kvs]
        spec = dict(model=str(model), variants=variants, prompt=prompt, prompts=prompts, temperature=temp,
                    blocks=REQUESTS * ((LENS[1] + OUT_LEN) // 16 + 2), batch_1_only=a.batch_1_only,
                    max_num_batched_tokens=a.max_num_batched_tokens)
        best: dict = {}
        tokens: dict = {}
        paths = None
        loads = [os.getloadavg()[0]]  # the machine's 1-minute load average, before and after each round
        for r in range(a.rounds):
            for name, (fmt, q) in formats.items():
                # Each engine's round in processes of its own: llama-bench, llama-server, paged-jax's child.
                rates = {("llama.cpp", "decode"): llama_bench(bin_dir, ggufs[fmt], a.llama_threads)}
                if not a.batch_1_only:
                    rate, tokens["llama.cpp", name] = max((llama_server(bin_dir, ggufs[fmt], prompts, a.port, t, temp,
                                                                        ctype) for t in a.llama_threads),
                                                          key=lambda o: o[0])
                    rates["llama.cpp", "batch"] = rate
                ours = paged_jax_child(dict(spec, quantization=q))
                paths = ours["paths"]
                rates.update({tuple(cell.split("|")): rate for cell, rate in ours["rates"].items()})
                tokens.update({(column, name): toks for column, toks in ours["tokens"].items()})
                for (engine, kind), rate in rates.items():
                    best[engine, kind, name] = max(best.get((engine, kind, name), 0.0), rate)
                print(f"round {r + 1}, {name}: " + ", ".join(f"{e} {k} {best[e, k, name]:.1f}" for e, k in rates),
                      file=sys.stderr)
            loads.append(os.getloadavg()[0])
    name, isa = cpu()
    print(f"CPU: {name}, {os.cpu_count()} cores; instruction sets: {isa}")
    print(f"builds: llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON} ({' '.join(CMAKE_ISA[a.isa])}); paged-jax "
          f"native kernels {paths or 'not built'}"
          + (f", PAGED_JAX_NATIVE_FLAGS={os.environ.get('PAGED_JAX_NATIVE_FLAGS')}" if a.isa == "avx2" else ""))
    print(f"best of {a.rounds} alternating rounds; 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
          f"(before and after each round)" + (f"; temperature {temp} (llama-bench: no sampling)" if temp else "")
          + f"; KV caches: llama-server's {ctype}, llama-bench's f16, paged-jax's {' / '.join(kvs)}; paged-jax's "
          + "token budget "
          + (str(a.max_num_batched_tokens) if a.max_num_batched_tokens else "the engine's default") + "\n")
    t = "/".join(map(str, a.llama_threads))
    ours = "".join(f" paged-jax, {_label(v)} | over it |" for v in variants)
    rule = "|---|---:|" + "---:|---:|" * len(variants)
    print(f"| batch-1 decode, {PROMPT}-token context, tokens/s | llama.cpp (llama-bench -t {t}) |{ours}")
    print(rule)
    for n, (fmt, q) in formats.items():
        print(f"| {n} ({fmt} / quantization={q!r}) | {best['llama.cpp', 'decode', n]:.1f} |"
              + _ratios(best, "decode", n, variants))
    if a.batch_1_only:
        return
    print(f"\n| {REQUESTS} requests, prompts {LENS[0]}-{LENS[1]}, {OUT_LEN} tokens out, output tokens/s (paged-jax: "
          f"its second call) | llama.cpp (llama-server -np {REQUESTS} -cb -t {t}) |{ours}")
    print(rule)
    for n, (fmt, q) in formats.items():
        print(f"| {n} ({fmt} / quantization={q!r}) | {best['llama.cpp', 'batch', n]:.1f} |"
              + _ratios(best, "batch", n, variants))
    for v in variants if temp == 0 and "float32" in formats else ():  # sampled outputs differ by design
        same = sum(x == y for x, y in zip(tokens["llama.cpp", "float32"], tokens[_column(v), "float32"]))
        print(f"\nfloat32, {_label(v)}: {same} of {REQUESTS} requests' {OUT_LEN} greedy tokens "
              f"the same on both engines")


def _label(variant: tuple) -> str:
    """A paged-jax variant's options: its num_scheduler_steps and kv_cache_dtype."""
    k, kv = variant
    return f"num_scheduler_steps={k}, kv_cache_dtype={kv}"


def _column(variant: tuple) -> str:
    """A paged-jax column's name (its cells' key)."""
    return f"paged-jax {_label(variant)}"


def _ratios(best: dict, kind: str, fmt: str, variants: list) -> str:
    """A table row's paged-jax cells: each variant's rate and its ratio over llama.cpp's."""
    lc = best["llama.cpp", kind, fmt]
    return "".join(f" {best[_column(v), kind, fmt]:.1f} | {best[_column(v), kind, fmt] / lc:.2f}x |" for v in variants)


if __name__ == "__main__":
    main()
