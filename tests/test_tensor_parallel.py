"""Tensor parallelism: tp=2 and tp=4 give tp=1's greedy tokens, and the arrays are really split.

The engines run in a subprocess with 4 forced CPU devices (``tests/tp_worker.py``), so
this session keeps its single device. tp=1 is the oracle here (it is itself checked
against Hugging Face in test_engine.py); the runs with tp > 1 use a pool small enough
that requests are preempted (swap for tp=2, recompute for tp=4).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paged_jax.engine import EngineArgs

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [np.random.default_rng(i).integers(3, 512, size=n).tolist() for i, n in enumerate(range(3, 48, 4))]
MAX_TOKENS = 16
AMPLE = dict(num_kv_blocks=128, block_size=8)
SHARED_SAMPLING = dict(n=3, temperature=0.8, seed=7)
TIGHT = dict(num_kv_blocks=16, block_size=8)  # 15 usable blocks of 8 tokens for 12 prompts of up to 59 tokens


MOE_RUN = dict(prompts=PROMPTS[::3], max_tokens=8)


def run_worker(tmp_path, jobs, devices=4, timeout=900):
    spec, out = tmp_path / "jobs.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"devices": devices, "jobs": jobs}))
    # the worker inherits this environment and sets its device count (tests.host_devices)
    proc = subprocess.run([sys.executable, "-m", "tests.tp_worker", str(spec), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def job(model, tp, **kw):
    return dict(model=str(model), tp=tp, prompts=PROMPTS, max_tokens=MAX_TOKENS, **kw)


def assert_same_outputs(got, want, what):
    for i, (g, w) in enumerate(zip(got["tokens"], want["tokens"])):
        assert g == w, f"{what}, prompt {i}: {g} != {w}"
    np.testing.assert_allclose(got["cum_logprobs"], want["cum_logprobs"], rtol=1e-4, atol=1e-4)
    assert got["all_free"]


@pytest.fixture(scope="module")
def tp_runs(hf_model_dir, tmp_path_factory):
    """One worker process for all default-suite runs (JAX starts once)."""
    from paged_jax.cli import main

    ckpt = tmp_path_factory.mktemp("ckpt") / "llama_gqa"
    assert main(["convert", "--model", str(hf_model_dir("llama_gqa")), "--out", str(ckpt)]) == 0
    jobs = variant_jobs(hf_model_dir, "llama_gqa")
    # tp=2 reads the orbax checkpoint (sharded as it loads) where tp=4 and the shared-prefix runs read
    # the Hugging Face folder: one run covers both the swap preemption and the orbax round trip.
    jobs[("llama_gqa", 2)]["model"] = str(ckpt)
    # Parallel samples share the prompt's blocks and copy the last one when they diverge (copy-on-write).
    shared = dict(prompts=PROMPTS[:4], max_tokens=8, sampling=SHARED_SAMPLING, enable_prefix_caching=True, **AMPLE)
    for tp in (1, 2):
        jobs[("shared", tp)] = {**job(hf_model_dir("llama_gqa"), tp), **shared}
    # A mixture of 8 experts split over 2 devices (4 each); under preemption, other families: slow tests
    jobs[("qwen3_moe", 2)] = dict(job(hf_model_dir("qwen3_moe"), 2, **AMPLE), **MOE_RUN)
    results = run_worker(tmp_path_factory.mktemp("tp"), list(jobs.values()))
    return dict(zip(jobs, results)), ckpt


def variant_jobs(hf_model_dir, variant) -> dict:
    """tp=1 (the oracle), tp=2 under swap and tp=4 under recompute preemption."""
    path = hf_model_dir(variant)
    return {(variant, 1): job(path, 1, **AMPLE), (variant, 2): job(path, 2, preemption_mode="swap", **TIGHT),
            (variant, 4): job(path, 4, preemption_mode="recompute", **TIGHT)}


@pytest.fixture(scope="module")
def tp_runs_opt(hf_model_dir, tmp_path_factory):
    """OPT's runs (slow tests only: the default set's LLaMA runs cover the same code)."""
    jobs = variant_jobs(hf_model_dir, "opt_pre")
    return dict(zip(jobs, run_worker(tmp_path_factory.mktemp("tp_opt"), list(jobs.values()))))


VARIANTS = ["llama_gqa", pytest.param("opt_pre", marks=pytest.mark.slow)]


def runs_of(variant, request) -> dict:
    return request.getfixturevalue("tp_runs")[0] if variant == "llama_gqa" else request.getfixturevalue("tp_runs_opt")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tp, mode", [(2, "swap"), (4, "recompute")])
def test_tp_greedy_matches_tp1_under_preemption(request, variant, tp, mode):
    runs = runs_of(variant, request)
    got = runs[(variant, tp)]
    assert got["preemptions"][mode] > 0, got["preemptions"]
    assert_same_outputs(got, runs[(variant, 1)], f"{variant} tp={tp}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tp", [2, 4])
def test_params_and_kv_cache_are_split(request, variant, tp):
    """Each device holds its fraction: columns of Q/up/fc1, rows of O/down/fc2, the vocabulary
    of the embedding, and its KV heads of the cache (read after swaps and copies)."""
    runs = runs_of(variant, request)
    full, got = runs[(variant, 1)]["shards"], runs[(variant, tp)]["shards"]
    for name, shards in full.items():
        assert len(shards) == 1
        assert len(got[name]) == tp, name
    split = {"q.w": 1, "up.w": 1, "fc1.w": 1, "o.w": 0, "down.w": 0, "fc2.w": 0, "embed": 0}
    for name, axis in split.items():
        if name in full:
            want = list(full[name][0])
            want[axis] //= tp
            assert got[name] == [want] * tp, (name, got[name])
    _, bs, kvh, d = full["kv_cache"][0]
    kv_heads = runs[(variant, tp)]["num_kv_heads"]
    # llama_gqa has 2 KV heads: at tp=4 each is replicated twice, so every device holds one.
    assert kv_heads == max(kvh, tp)
    assert got["k.w"] == [[full["k.w"][0][0], kv_heads * d // tp]] * tp
    assert got["kv_cache"] == [[TIGHT["num_kv_blocks"], bs, kv_heads // tp, d]] * tp


@pytest.mark.parametrize("variant", VARIANTS)
def test_step_communicates_like_megatron(request, variant):
    """XLA partitions the step without gathering weights: all-reduces (after the row-parallel
    layers and the vocab-split embedding) and one all-gather of the vocab-split logits; the greedy
    tokens the step returns are reduced over the vocabulary shards where they lie (each shard's
    maximum and its index gathered, the log-sum-exp of the greedy logprob all-reduced: [rows] each)."""
    coll = runs_of(variant, request)[(variant, 2)]["collectives"]
    assert set(coll) <= {"all-reduce", "all-gather"}, coll
    reduces = [s.split("{")[0] for s in coll["all-reduce"]]
    assert reduces.count("f32[2]") <= 1, coll  # the greedy logprob's log-sum-exp, [rows]
    hidden = [s for s in reduces if s != "f32[2]"]
    assert 1 <= len(hidden) <= 2 * 2 + 1, coll  # 2 layers: attention output, MLP down; embedding
    assert all(s == "f32[2,64]" for s in hidden), coll  # [rows, hidden]: no weight is gathered
    gathers = sorted(s.split("{")[0] for s in coll.get("all-gather", []))
    assert gathers in (["f32[2,512]"], ["f32[2,2]", "f32[2,512]", "s32[2,2]"]), coll  # logits; greedy per shard


def transformers_greedy(model, prompts, max_tokens) -> list:
    """Each prompt's greedy tokens by transformers' ``generate`` (``model``: a folder or a loaded model)."""
    import torch

    from tests.hf_models import load_hf

    hf = load_hf(model) if isinstance(model, (str, Path)) else model
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def test_expert_parallel_greedy_equals_transformers(tp_runs, hf_model_dir):
    """tp=2 on a mixture of experts: each device holds 4 of the 8 experts (and its half of the
    attention heads); greedy tokens equal transformers' for each prompt alone, and the step gathers
    no weights (all-reduces, and the logits' all-gather)."""
    got = tp_runs[0][("qwen3_moe", 2)]
    assert got["all_free"]
    assert got["shards"]["experts.gate"] == [[4, 64, 48]] * 2 and got["shards"]["experts.down"] == [[4, 48, 64]] * 2
    assert set(got["collectives"]) <= {"all-reduce", "all-gather"}, got["collectives"]
    want = transformers_greedy(hf_model_dir("qwen3_moe"), MOE_RUN["prompts"], MOE_RUN["max_tokens"])
    assert got["tokens"] == want


def test_tp_parallel_samples_with_copy_on_write(tp_runs):
    """n=3 seeded samples per prompt: forks, copy-on-write block copies on the split cache."""
    runs, _ = tp_runs
    got, want = runs[("shared", 2)], runs[("shared", 1)]
    assert got["samples"] == want["samples"]
    assert all(len(set(map(tuple, s))) > 1 for s in want["samples"])  # the samples diverged
    assert got["blocks_copied"] > 0
    assert got["shards"]["kv_cache"] == [[AMPLE["num_kv_blocks"], 8, 1, 16]] * 2
    assert got["all_free"]


def test_orbax_checkpoint_round_trip_loads_sharded(tp_runs):
    runs, ckpt = tp_runs
    assert (ckpt / "paged_jax_checkpoint.json").is_file() and (ckpt / "params").is_dir()
    assert not list(ckpt.glob("*.safetensors"))  # the weights come from orbax, not from a copied file
    got = runs[("llama_gqa", 2)]  # the tp=2 run under swap preemption loaded this checkpoint
    assert got["shards"]["q.w"] == [[64, 32], [64, 32]]
    assert_same_outputs(got, runs[("llama_gqa", 1)], "orbax tp=2")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama_tied_scaled", "opt_post", "gpt2", "qwen2_tied_window",
                                     "mistral_window", "qwen3_window", "gemma2", "phi3_longrope"])
def test_tp_more_families(hf_model_dir, tmp_path, variant):
    """MQA (1 KV head, replicated), tied embeddings, biases; OPT post-LN with project_in/out; GPT-2;
    Qwen2 (replicated K/V heads with biases, a sliding window on layer 1)."""
    path = hf_model_dir(variant)
    jobs = [job(path, 1, **AMPLE), job(path, 2, **AMPLE), job(path, 4, preemption_mode="swap", **TIGHT)]
    base, *others = run_worker(tmp_path, jobs)
    for tp, got in zip((2, 4), others):
        assert_same_outputs(got, base, f"{variant} tp={tp}")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_expert_parallel_under_preemption_and_from_orbax(hf_model_dir, tmp_path, variant):
    """Every MoE family at tp=2 (swap) and tp=4 (recompute; Qwen2-MoE's and Mixtral's 4 experts one
    to a device), and restored from an orbax checkpoint straight into its shards at tp=2: greedy
    tokens equal transformers'."""
    from paged_jax.parallel.checkpoint import convert

    path = hf_model_dir(variant)
    ckpt = convert(path, tmp_path / "ckpt")
    runs = run_worker(tmp_path, [job(path, 2, preemption_mode="swap", **TIGHT),
                                 job(path, 4, preemption_mode="recompute", **TIGHT), job(ckpt, 2, **AMPLE)])
    want = transformers_greedy(path, PROMPTS, MAX_TOKENS)
    for tp, got in zip((2, 4, 2), runs):
        assert got["tokens"] == want and got["all_free"], tp
        assert got["shards"]["experts.gate"][0][0] == FAMILY_EXPERTS[variant] // tp
    assert runs[0]["preemptions"]["swap"] > 0 and runs[1]["preemptions"]["recompute"] > 0


FAMILY_EXPERTS = {"mixtral": 4, "qwen2_moe": 4, "qwen3_moe": 8}


@pytest.mark.slow  # 130 s at load 6-7 on 2 cores: a process with 4 CPU devices
def test_tp_gemma3_layer_groups(hf_model_dir, tmp_path):
    """Gemma 3's six layer groups split over 2 devices, and over 4 (its 2 KV heads replicated) under swap
    preemption with prompts in 16-token chunks (the windowed groups' blocks taken chunk by chunk):
    greedy tokens equal transformers'."""
    path, prompts = hf_model_dir("gemma3"), PROMPTS[::2]
    tight = dict(num_kv_blocks=40, block_size=8, max_num_batched_tokens=16, preemption_mode="swap")
    runs = run_worker(tmp_path, [dict(job(path, 2, **AMPLE), prompts=prompts),
                                 dict(job(path, 4, **tight), prompts=prompts)])
    want = transformers_greedy(path, prompts, MAX_TOKENS)
    for tp, got in zip((2, 4), runs):
        assert got["tokens"] == want and got["all_free"], tp
    assert runs[1]["preemptions"]["swap"] > 0


@pytest.mark.slow
def test_tp_with_pallas_backend(hf_model_dir, tmp_path):
    """The Pallas kernels (interpret mode on the CPU) run per device inside shard_map."""
    path = hf_model_dir("llama_gqa")
    short = dict(prompts=PROMPTS[:3], max_tokens=6)
    base, got = run_worker(tmp_path, [{**job(path, 1, **AMPLE), **short},
                                      {**job(path, 2, attention_backend="pallas-interpret", **AMPLE), **short}],
                            devices=2)
    assert got["tokens"] == base["tokens"]


# ---- errors, in this process (one device) -------------------------------------------------------

def test_bad_tensor_parallel_size_is_refused_before_weights_load(hf_model_dir, tmp_path):
    from paged_jax import LLM

    bare = tmp_path / "config-only"  # no weights at all: the error must come from the head check
    bare.mkdir()
    (bare / "config.json").write_text((hf_model_dir("llama_gqa") / "config.json").read_text())
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(model=str(bare), tokenizer=str(hf_model_dir("llama_gqa")), tensor_parallel_size=3)
    import jax

    if jax.device_count() == 1:  # the usual test session
        with pytest.raises(ValueError, match="tensor_parallel_size=2 but only 1 cpu device"):
            LLM(model=str(bare), tokenizer=str(hf_model_dir("llama_gqa")), tensor_parallel_size=2)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            EngineArgs(tensor_parallel_size=bad)


def test_kv_head_rules():
    from paged_jax.models import model_config_from_hf
    from paged_jax.parallel import check_tensor_parallel

    cfg = model_config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 96,
                                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 12,
                                "num_key_value_heads": 3, "max_position_embeddings": 64})
    assert check_tensor_parallel(cfg, 3) == (cfg, 1)
    run, rep = check_tensor_parallel(cfg, 6)  # 3 KV heads over 6 devices: each replicated twice
    assert (run.num_kv_heads, rep) == (6, 2) and run.num_heads == 12
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and the model's 3 KV heads do not fit"):
        check_tensor_parallel(cfg, 2)
    mqa = dataclasses.replace(cfg, num_kv_heads=1)
    assert check_tensor_parallel(mqa, 4)[0].num_kv_heads == 4


# ---- several hosts: two processes on loopback, JAX's CPU collectives (gloo) --------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_serve_one_model(hf_model_dir, tmp_path):
    """jax.distributed.initialize in two processes of 2 CPU devices each: one tp=4 mesh over both,
    with swap preemption (swapped blocks are gathered from both processes); both processes
    produce tp=1's tokens."""
    path = hf_model_dir("llama_gqa")
    (tmp_path / "single").mkdir()
    (want,) = run_worker(tmp_path / "single", [job(path, 1, **AMPLE)], devices=1)
    addr = f"127.0.0.1:{free_port()}"
    procs, outs = [], []
    for pid in range(2):
        spec, out = tmp_path / f"jobs{pid}.json", tmp_path / f"out{pid}.json"
        spec.write_text(json.dumps({"devices": 2, "jobs": [job(path, 4, preemption_mode="swap", **TIGHT)],
                                    "distributed": {"coordinator_address": addr, "num_processes": 2,
                                                    "process_id": pid}}))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.tp_worker", str(spec), str(out)], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    for out in outs:
        (got,) = json.loads(out.read_text())
        assert got["preemptions"]["swap"] > 0
        assert got["shards"]["kv_cache"] == [[TIGHT["num_kv_blocks"], 8, 1, 16]] * 2  # 2 of the 4 shards here
        assert_same_outputs(got, want, "2 processes, tp=4")


@pytest.mark.parametrize("variant, dtype", [("opt_post", "bfloat16"), ("llama_tied_scaled", "auto"),
                                            ("qwen2_untied", "auto"), ("qwen3_moe", "auto")])
def test_orbax_checkpoint_restores_the_same_params(hf_model_dir, tmp_path, variant, dtype):
    """convert -> restore (one device) gives exactly the arrays the safetensors loader gives, in the
    converted dtype; a second convert into the same folder is refused."""
    import jax

    from paged_jax.models.loader import load_model
    from paged_jax.executor.loading import load_for_serving
    from paged_jax.parallel.checkpoint import convert

    src = hf_model_dir(variant)
    ckpt = convert(src, tmp_path / "ckpt", dtype)
    config, params, mesh = load_for_serving(ckpt, "auto", 1)
    want_config, want = load_model(src, dtype)
    assert config == want_config and mesh.shape == {"tp": 1}
    got_leaves, got_tree = jax.tree_util.tree_flatten(params)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype == jax.numpy.dtype(want_config.dtype)
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with pytest.raises(ValueError, match="exists and is not empty"):
        convert(src, ckpt)


def test_weight_roles_map_to_megatron_specs():
    """Each weight object's ``parallel`` role picks its PartitionSpec; dims tp does not divide stay whole."""
    import jax
    from jax.sharding import PartitionSpec as P

    from paged_jax.weights import DenseEmbedding, DenseLinear
    from paged_jax.parallel.rules import weight_specs

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, "float32")

    col = weight_specs(DenseLinear(s(8, 16), s(16), "column"), 4)
    assert (col.w, col.b) == (P(None, "tp"), P("tp"))
    row = weight_specs(DenseLinear(s(16, 8), s(8), "row"), 4)
    assert (row.w, row.b) == (P("tp", None), P())
    kv = DenseLinear(s(8, 16), s(16), "kv")
    assert weight_specs(kv, 4).w == P(None, "tp") and weight_specs(kv, 4, replicate_kv=True).w == P()
    assert weight_specs(DenseLinear(s(8, 16), None, None), 4).w == P()
    assert weight_specs(DenseEmbedding(s(517, 8)), 4).table == P(None, None)  # 517 rows: not divisible by 4
    assert weight_specs(DenseEmbedding(s(516, 8)), 4).table == P("tp", None)
    with pytest.raises(ValueError, match="parallel must be one of"):
        DenseLinear(s(8, 16), None, "columns")
