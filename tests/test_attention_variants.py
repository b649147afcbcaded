"""Attention variants: the shipped ones against a numpy oracle, user registration, and the
notebook notebooks/attention_variants.ipynb executed end to end (with nbclient, at small size)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import jax.numpy as jnp

from paged_jax.attention import (AttentionMetadata, AttentionSpec, ReferenceBackend, get_backend,
                                 paged_attention_reference, register_backend)
from paged_jax.attention.variants import (sliding_window_attention, sliding_window_backend, soft_cap_attention,
                                          soft_cap_backend)
from tests.attention_oracle import numpy_attention

ROOT = Path(__file__).resolve().parent.parent


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


def run_prefill(backend, spec, q, k, v, tables, lens, qlens):
    meta = AttentionMetadata(slot_mapping=None, token_seq=None, block_tables=jnp.asarray(tables),
                             context_lens=jnp.asarray(lens), query_lens=jnp.asarray(qlens))
    return np.asarray(backend.prefill(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), meta, spec))


@pytest.mark.parametrize("window,cap", [(None, None), (3, None), (None, 0.5), (5, 2.0)])
def test_reference_backend_honours_the_spec_and_variant_backends_add_hooks(window, cap):
    """The spec's window and cap (the model's), or the same as a variant's hooks on a plain spec: numpy's result."""
    q, k, v, tables, lens, qlens = random_case(2)
    want = numpy_attention(q, k, v, tables, lens, qlens, 0.3, window=window, cap=cap)
    got = {"spec": run_prefill(get_backend("reference"), AttentionSpec(0.3, window, cap), q, k, v, tables, lens,
                               qlens)}
    hooks = ReferenceBackend("hooks", score_mod=None if cap is None else soft_cap_backend(cap).score_mod,
                             mask_mod=None if window is None else sliding_window_backend(window).mask_mod)
    got["hooks"] = run_prefill(hooks, AttentionSpec(0.3), q, k, v, tables, lens, qlens)
    for how, out in got.items():
        for s, n in enumerate(qlens):
            np.testing.assert_allclose(out[s, :n], want[s, :n], atol=1e-5, err_msg=how)
    # Decode (each sequence's last query) takes the same variants.
    meta = AttentionMetadata(slot_mapping=None, token_seq=None, block_tables=jnp.asarray(tables),
                             context_lens=jnp.asarray(lens), query_lens=jnp.ones(3, jnp.int32))
    last = np.stack([q[s, n - 1] for s, n in enumerate(qlens)])
    dec = np.asarray(get_backend("reference").decode(jnp.asarray(last), jnp.asarray(k), jnp.asarray(v), meta,
                                                     AttentionSpec(0.3, window, cap)))
    np.testing.assert_allclose(dec, np.stack([want[s, n - 1] for s, n in enumerate(qlens)]), atol=1e-5)


def test_register_backend_rejects_bad_input():
    with pytest.raises(ValueError, match="name must be a non-empty string other than 'auto', got ''"):
        register_backend(ReferenceBackend(""))
    with pytest.raises(ValueError, match="name must be a non-empty string other than 'auto', got 'auto'"):
        register_backend(ReferenceBackend("auto"))
    with pytest.raises(ValueError, match="non-empty string .* got None"):
        register_backend(paged_attention_reference)  # a function is not a backend object
    broken = ReferenceBackend("broken")
    broken.prefill = 42
    with pytest.raises(ValueError, match="backend 'broken' must have a callable check method and ragged, or decode "
                                         "and prefill; it has check, decode"):
        register_backend(broken)
    broken.ragged = lambda *args: None  # a ragged kernel alone is enough
    register_backend(broken)
    with pytest.raises(ValueError, match="window must be an integer >= 1, got 0"):
        sliding_window_backend(0)
    with pytest.raises(ValueError, match="cap must be a number > 0, got -1"):
        soft_cap_backend(-1)


class CountingBackend(ReferenceBackend):
    """The reference, recording the shapes it is traced with."""

    def __init__(self, name):
        super().__init__(name)
        self.calls = []

    def decode(self, q, *args):
        self.calls.append(("decode", q.shape))
        return super().decode(q, *args)

    def prefill(self, q, *args):
        self.calls.append(("prefill", q.shape))
        return super().prefill(q, *args)


def test_user_backend_runs_in_the_engine(tiny_llama_dir):
    """A registered backend is what the engine calls (counted at trace time), and its output is used."""
    from paged_jax import LLM, SamplingParams

    counting = CountingBackend("test-counting")
    register_backend(counting)
    register_backend(soft_cap_backend(1e-6, name="test-uniform"))  # ~uniform attention
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 9, 200, 31, 7, 77], [42, 43]]
    toks = {}
    for name in ("reference", "test-counting", "test-uniform"):
        llm = LLM(model=str(tiny_llama_dir), attention_backend=name, num_kv_blocks=16)
        assert llm.llm_engine.get_stats()["attention_backend"] == name
        toks[name] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                   use_tqdm=False)]
    kinds = {kind for kind, _ in counting.calls}
    assert kinds == {"decode", "prefill"}
    assert all(len(shape) == (3 if kind == "decode" else 4) for kind, shape in counting.calls)
    assert toks["test-counting"] == toks["reference"]
    assert toks["test-uniform"] != toks["reference"]


@pytest.mark.slow  # 20 s; the variants it shows are checked one by one in the tests above
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
