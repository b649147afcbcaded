"""``python -m experiments.reproduce``: figures, CSVs and the headline table, at a tiny size."""

from __future__ import annotations

import csv

import pytest

from experiments import fig_ablation, reproduce


def test_reproduce_one_figure_writes_png_csv_and_headlines(tmp_path, monkeypatch):
    monkeypatch.setattr(fig_ablation, "trace_len", lambda workload, quick, n=1: 40)
    assert reproduce.main(["--quick", "--figure", "19", "--out", str(tmp_path), "--jobs", "1"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"fig19_recompute_vs_swap.png", "fig19a_per_block_cost.csv", "fig19b_recompute_vs_swap.csv",
            "headlines_19.csv"} <= names
    rows = list(csv.DictReader(open(tmp_path / "fig19b_recompute_vs_swap.csv")))
    assert {r["preemption_mode"] for r in rows} == {"recompute", "swap"}
    assert all(float(r["normalized_latency"]) > 0 for r in rows)
    heads = list(csv.DictReader(open(tmp_path / "headlines_19.csv")))
    assert any("swap / recompute" in h["metric"] for h in heads)


def test_readme_table(tmp_path):
    ctx = reproduce.Context(str(tmp_path))
    ctx.headline("12", "ratio", "1.7-2.7x", 2.0, (1.7, 2.7))
    ctx.headline("13", "batched", 30.42, 10.0, (20, 40), "fast iterations")
    reproduce.write_readme(ctx, {"12": 1.0}, "--quick")
    text = (tmp_path / "README.md").read_text()
    assert "| 12 | ratio | 1.7-2.7x | 2 |  | 1.7-2.7 | in band |  |" in text
    assert "| 13 | batched | 30.42 | 10 | 0.33 | 20-40 | OUTSIDE band | fast iterations |" in text


def test_bad_arguments():
    with pytest.raises(SystemExit):
        reproduce.main(["--figure", "99"])
    with pytest.raises(SystemExit):
        reproduce.main(["--jobs", "0"])


# 11 s: -m slow (test_reproduce_one_figure_writes_png_csv_and_headlines runs a figure by default)
@pytest.mark.slow
def test_fig14_ratios_come_from_the_matching_capacity_runs(tmp_path, monkeypatch):
    from experiments import fig_serving, fig_sharing

    tiny = lambda workload, quick, n=1: 30  # noqa: E731
    monkeypatch.setattr(fig_sharing, "trace_len", tiny)
    monkeypatch.setattr(fig_serving, "trace_len", tiny)
    assert reproduce.main(["--quick", "--figure", "14", "--out", str(tmp_path), "--jobs", "1"]) == 0
    caps = {(r["system"], r["n"], r["beam_width"]): float(r["capacity"])
            for r in csv.DictReader(open(tmp_path / "fig14_capacity.csv"))}
    assert len(caps) == 6  # 3 kinds x 2 systems, none overwritten
    heads = {h["metric"]: float(h["ours"]) for h in csv.DictReader(open(tmp_path / "headlines_14.csv"))}
    for (n, beam), label in {("1", "0"): "basic sampling", ("6", "0"): "parallel n=6",
                             ("1", "6"): "beam width 6"}.items():
        expect = caps[("vllm", n, beam)] / caps[("orca-oracle", n, beam)]
        assert heads[f"OPT-13B Alpaca {label}: sustainable rate vs Orca(Oracle)"] == pytest.approx(expect, rel=1e-3)


# 13 s: -m slow (the 8-bit cache's slots are counted in tests/test_kv_quant.py by default)
@pytest.mark.slow
def test_an_8bit_kv_cache_doubles_the_slots_and_raises_the_sustainable_rate(tmp_path, monkeypatch):
    """Beyond the paper: the same memory holds (2 * 128 bytes) / (128 + 2) times the tokens of OPT-13B's
    16-bit cache, and the real scheduler fits more ShareGPT requests in it."""
    from experiments import fig_serving
    from experiments.hardware import get_setup

    fp16, kv8 = get_setup("opt-13b"), get_setup("opt-13b-kv8")
    assert kv8.model.kv_bytes_per_token * 256 == fp16.model.kv_bytes_per_token * 130
    assert kv8.kv_slots == int(15_700 * 256 / 130)
    monkeypatch.setattr(fig_serving, "trace_len", lambda workload, quick, n=1: 120)
    assert reproduce.main(["--quick", "--figure", "kv8", "--out", str(tmp_path), "--jobs", "1"]) == 0
    caps = {r["setup"]: float(r["capacity"]) for r in csv.DictReader(open(tmp_path / "figkv8_capacity.csv"))}
    heads = {h["metric"]: float(h["ours"]) for h in csv.DictReader(open(tmp_path / "headlines_kv8.csv"))}
    ratio = heads["OPT-13B ShareGPT: sustainable rate, 8-bit KV / 16-bit KV"]
    assert ratio == pytest.approx(caps["opt-13b-kv8"] / caps["opt-13b"], rel=1e-3) and ratio > 1.1
    assert (tmp_path / "figkv8_latency.png").is_file()
