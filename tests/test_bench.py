"""Smoke tests of the benchmark scripts at tiny sizes (their figures are measured, not asserted)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import bench_common  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from paged_jax.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"), family="gpt2", seed=2))


def _args(**kw):
    base = dict(num_prompts=16, dataset=None, input_len=None, output_len=None, max_total_len=512, seed=0)
    return SimpleNamespace(**{**base, **kw})


def test_requests_fixed_lengths_and_errors():
    reqs = bench_common.make_requests(_args(input_len=5, output_len=7), vocab_size=100)
    assert len(reqs) == 16 and all(len(r.prompt_token_ids) == 5 and r.output_len == 7 for r in reqs)
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    assert bench_common.make_requests(_args(input_len=5, output_len=7), 100)[3] == reqs[3]  # seeded
    with pytest.raises(ValueError, match="--input-len"):
        bench_common.make_requests(_args(input_len=5), 100)
    with pytest.raises(ValueError, match="not both"):
        bench_common.make_requests(_args(dataset="sharegpt", input_len=5, output_len=5), 100)


def test_requests_from_dataset_are_scaled():
    workloads = pytest.importorskip("experiments.workloads")
    reqs = bench_common.make_requests(_args(dataset="sharegpt-like", num_prompts=200), vocab_size=1000)
    ins, outs = workloads.sample_lengths("sharegpt", 200, 0)
    got = np.array([len(r.prompt_token_ids) + r.output_len for r in reqs])
    assert got.max() <= 512 and got.min() >= 2
    # Scaled by 512 / 2048: the mean total is about a quarter of the unscaled one.
    assert abs(got.mean() - (ins + outs).mean() / 4) < 0.05 * got.mean()


def test_throughput_and_latency_scripts(gpt2_dir, capsys):
    import bench_latency
    import bench_throughput

    out = bench_throughput.main(["--model", gpt2_dir, "--num-prompts", "6", "--input-len", "5", "--output-len", "4",
                                 "--max-num-seqs", "4", "--no-warm-up", "--max-total-len", "16"])
    assert out["requests_per_s"] > 0 and out["tokens_per_s"] > out["output_tokens_per_s"] > 0
    text = capsys.readouterr().out
    assert "requests/s" in text and "p99" in text and "device" in text
    out = bench_latency.main(["--backend", "hf", "--model", gpt2_dir, "--batch-size", "3", "--input-len", "4",
                              "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0"])
    assert out["avg_latency_s"] > 0


def test_step_cost_counts_gpt2_124m():
    import roofline

    from paged_jax.models import model_config_from_hf

    cfg = model_config_from_hf(dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=768, n_layer=12,
                                    n_head=12, n_positions=1024, vocab_size=50257, tie_word_embeddings=True),
                               dtype="float32")
    flops, nbytes = roofline.step_cost(cfg, 124_439_808, batch=1, context=0)
    # GPT-2 small: 85M weights in the blocks plus the 38.6M LM head, 2 FLOPs per multiply-add.
    assert flops == 2 * (12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072) + 768 * 50257)
    assert nbytes == 124_439_808 * 4 + 50257 * 4
    f2, b2 = roofline.step_cost(cfg, 124_439_808, batch=2, context=100)
    assert f2 == 2 * flops + 2 * 2 * 2 * 100 * 12 * 768 and b2 - 2 * nbytes + 124_439_808 * 4 == 2 * 100 * 12 * 2 * 768 * 4


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_matmuls_alone_chains_every_weight_of_each_family(family, tmp_path):
    import roofline

    from paged_jax.models.tiny import make_tiny_model
    from paged_jax.executor.loading import load_for_serving

    from paged_jax.weights.panels import to_panels

    cfg, params, _ = load_for_serving(str(make_tiny_model(tmp_path / family, family=family, seed=0)), "float32", 1,
                                      native_kernels=False)
    out = roofline.matmuls_alone(params, cfg.hidden_size, 3)()
    assert out.shape == (3, cfg.vocab_size)
    packed = roofline.matmuls_alone(to_panels(params), cfg.hidden_size, 3)()  # the native matmuls
    np.testing.assert_allclose(np.asarray(packed)[:, :cfg.vocab_size], np.asarray(out), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compare_and_roofline(gpt2_dir, capsys):
    import bench_throughput
    import roofline

    bench_throughput.main(["--compare", "--model", gpt2_dir, "--num-prompts", "6", "--input-len", "6",
                           "--output-len", "6", "--max-total-len", "16", "--hf-sequential-prompts", "2",
                           "--hf-batch-sizes", "2,6", "--num-kv-blocks", "9", "--block-size", "4"])
    text = capsys.readouterr().out
    assert "Orca(Max)" in text and "HF static batches (best:" in text and "x\n" in text
    out = roofline.main(["--model", gpt2_dir, "--batches", "1,2", "--context", "8", "--repeats", "1",
                         "--profile-prompts", "2", "--profile-lens", "4,4"])
    assert all(0 < r["fraction"] for r in out["roofline"]) and out["profile"]["parts_s"]["device step"] > 0
    assert all(r["matmuls_ms"] > 0 and r["xla_step_ms"] > 0 and r["xla_matmuls_ms"] > 0 for r in out["roofline"])


@pytest.mark.slow
def test_itl_target_benchmark_quick(tmp_path, capsys):
    """bench_itl_target --quick: every configuration runs the scenario, the table and the figure come out."""
    import bench_itl_target

    figure = tmp_path / "itl.png"
    rows = bench_itl_target.main(["--quick", "--no-warm-up", "--figure", str(figure)])
    text = capsys.readouterr().out
    assert [(r["mode"], r["policy"]) for r in rows] == [("budget", "FCFS"), ("budget", "FCFS"), ("target", "ShortFirst")]
    assert all(r["short_ttft_s"] and r["num_shorts"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    # Streams of at most 32 tokens: fresh ones replaced them (4 at the start), the decode step measured at both ends.
    assert all(r["streams_started"] > 4 and r["decode_step_end_s"] > 0 for r in rows)
    assert "| target 5x decode step | ShortFirst |" in text and figure.stat().st_size > 10_000
    assert "each replaced by a fresh one after 32 tokens" in text
    assert figure.with_suffix(".json").exists()
