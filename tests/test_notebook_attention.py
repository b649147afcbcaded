"""Attention variants: the shipped ones against a numpy oracle, user registration, and the
notebook notebooks/attention_variants.ipynb executed end to end (with nbclient, at small size)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from paged_jax.attention import get_backend, paged_attention_reference, register_backend
from paged_jax.attention.variants import sliding_window_attention, soft_cap_attention

ROOT = Path(__file__).resolve().parent.parent


def numpy_attention(q, k_cache, v_cache, tables, lens, qlens, scale, window=None, cap=None):
    """Loop-per-query oracle: gather the sequence's tokens, causal softmax (optionally windowed / capped)."""
    S, Q, H, D = q.shape
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros_like(q)
    for s in range(S):
        n = lens[s]
        pos = np.arange(n)
        k = k_cache[tables[s, pos // bs], pos % bs]  # [n, KVH, D]
        v = v_cache[tables[s, pos // bs], pos % bs]
        for i in range(qlens[s]):
            p = n - qlens[s] + i
            seen = pos <= p if window is None else (pos <= p) & (pos > p - window)
            for h in range(H):
                kh = h // (H // KVH)
                x = k[seen, kh] @ q[s, i, h] * scale
                if cap is not None:
                    x = cap * np.tanh(x / cap)
                w = np.exp(x - x.max())
                out[s, i, h] = w @ v[seen, kh] / w.sum()
    return out


def random_case(seed=0, S=3, Q=6, H=4, KVH=2, D=8, bs=4, mb=5):
    rng = np.random.default_rng(seed)
    nb = S * mb + 1
    k = rng.normal(size=(nb, bs, KVH, D)).astype(np.float32)
    v = rng.normal(size=(nb, bs, KVH, D)).astype(np.float32)
    q = rng.normal(size=(S, Q, H, D)).astype(np.float32) * 3
    tables = rng.permutation(np.arange(1, nb))[: S * mb].reshape(S, mb).astype(np.int32)
    lens = np.array([20, 9, 1][:S], np.int32)
    qlens = np.array([6, 4, 1][:S], np.int32)
    return q, k, v, tables, lens, qlens


@pytest.mark.parametrize("window", [1, 3, 8, 100])
def test_sliding_window_matches_numpy(window):
    q, k, v, tables, lens, qlens = random_case()
    got = np.asarray(sliding_window_attention(q, k, v, tables, lens, qlens, 0.3, window=window))
    want = numpy_attention(q, k, v, tables, lens, qlens, 0.3, window=window)
    for s, n in enumerate(qlens):
        np.testing.assert_allclose(got[s, :n], want[s, :n], atol=1e-5)


@pytest.mark.parametrize("cap", [0.5, 5.0])
def test_soft_cap_matches_numpy(cap):
    q, k, v, tables, lens, qlens = random_case(1)
    got = np.asarray(soft_cap_attention(q, k, v, tables, lens, qlens, 0.3, cap=cap))
    want = numpy_attention(q, k, v, tables, lens, qlens, 0.3, cap=cap)
    plain = numpy_attention(q, k, v, tables, lens, qlens, 0.3)
    for s, n in enumerate(qlens):
        np.testing.assert_allclose(got[s, :n], want[s, :n], atol=1e-5)
    assert not np.allclose(want[0, :6], plain[0, :6], atol=1e-3), "the cap must matter in this case"


def test_reference_matches_numpy_and_variants_are_registered():
    q, k, v, tables, lens, qlens = random_case(2)
    got = np.asarray(paged_attention_reference(q, k, v, tables, lens, qlens, 0.3))
    want = numpy_attention(q, k, v, tables, lens, qlens, 0.3)
    for s, n in enumerate(qlens):
        np.testing.assert_allclose(got[s, :n], want[s, :n], atol=1e-5)
    assert get_backend("sliding-window") is sliding_window_attention
    assert get_backend("soft-cap") is soft_cap_attention


def test_register_backend_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty string"):
        register_backend("", paged_attention_reference)
    with pytest.raises(ValueError, match="must be a callable"):
        register_backend("broken", 42)


def test_user_backend_runs_in_the_engine(tiny_llama_dir):
    """A registered function is what the engine calls (counted at trace time), and its output is used."""
    from paged_jax import LLM, SamplingParams

    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        return paged_attention_reference(*args)

    register_backend("test-counting", counting)
    register_backend("test-uniform", functools.partial(soft_cap_attention, cap=1e-6))  # ~uniform attention
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 9, 200, 31, 7, 77], [42, 43]]
    toks = {}
    for name in ("reference", "test-counting", "test-uniform"):
        llm = LLM(model=str(tiny_llama_dir), attention_backend=name, num_kv_blocks=16)
        toks[name] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                   use_tqdm=False)]
    assert calls and all(len(shape) == 4 for shape in calls)
    assert toks["test-counting"] == toks["reference"]
    assert toks["test-uniform"] != toks["reference"]


def test_notebook_runs_and_checks_its_variants():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "attention_variants.ipynb", as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, "the notebook has one cell tagged 'parameters'"
    params[0].source = "NUM_PROMPTS = 3\nMAX_TOKENS = 8\nWINDOW = 8"
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "my-window-wide     [8, 8, 8]" in text, text
    assert "sequences changed by the narrow window or the tight cap" in text
