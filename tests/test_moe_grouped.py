"""The native grouped matmul of a mixture's experts (paged_jax/native/grouped_linear.cc) against numpy,
and the mixture run through it (float32 experts stored as PanelExpertStack, as the engine stores them
on a CPU with AVX-512) against the numpy reference of tests/test_moe.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import native
from paged_jax.native.grouped import grouped_linear
from tests.native_paths import PORTABLE_FLAGS, native_paths_report, run_build  # noqa: F401 (autouse: the paths report)
from tests.test_moe import numpy_moe, random_moe

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.status()}")


def grouped_case(rng, counts, K, N, past=0):
    """Rows sorted by expert (``counts`` each, then ``past`` rows of no expert), the experts' weights
    ``[E, K, N]``, the offsets and numpy's float64 product (zeros for the rows of no expert)."""
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x = rng.standard_normal((offsets[-1] + past, K)).astype(np.float32)
    w = rng.standard_normal((len(counts), K, N)).astype(np.float32)
    want = np.zeros((len(x), N))
    for e in range(len(counts)):
        want[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]].astype(np.float64) @ w[e]
    return x, w, offsets, want


def pack(w):
    return jnp.stack([native.pack_weight(jnp.asarray(we)) for we in w])


# experts with no rows, register-tile tails (1-9 rows), one expert past a 1024-row pass, rows of no
# expert at the end; panel widths 48, 32 and 16
CASES = [([3, 0, 9, 1, 0, 20, 2, 5], 40, 96, 4), ([0, 1100, 7], 8, 32, 0), ([0, 0, 17], 33, 80, 2),
         ([0, 0, 0, 0], 16, 48, 3)]


@needs_native
@pytest.mark.parametrize("counts,K,N,past", CASES)
def test_grouped_linear_matches_numpy(counts, K, N, past):
    x, w, offsets, want = grouped_case(np.random.default_rng(len(counts) + K), counts, K, N, past)
    got = np.asarray(jax.jit(grouped_linear)(jnp.asarray(x), jnp.asarray(offsets), pack(w)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    assert not got[offsets[-1]:].any()  # rows of no expert: zeros, whatever the buffer held


def test_grouped_linear_xla_fallback_matches_numpy(monkeypatch):
    """Without the library (or off the CPU) the same function in XLA."""
    monkeypatch.setattr(native.build, "loaded", lambda: False)
    x, w, offsets, want = grouped_case(np.random.default_rng(3), [3, 0, 9, 1], 40, 96, past=2)
    got = np.asarray(grouped_linear(jnp.asarray(x), jnp.asarray(offsets), pack(w)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@needs_native
def test_packed_stack_with_biases_matches_numpy():
    """gpt-oss's experts have biases: each row gets its own expert's; rows of no expert stay 0."""
    from paged_jax.weights import DenseLinear, ExpertStack
    from paged_jax.weights.panels import PanelExpertStack, experts_packable

    counts, K, N, past = [3, 0, 9, 1, 0, 20, 2, 5], 40, 72, 4  # 72 columns: padded to two 48-column panels
    rng = np.random.default_rng(7)
    x, w, offsets, want = grouped_case(rng, counts, K, N, past)
    b = rng.standard_normal((len(counts), N)).astype(np.float32)
    want[:offsets[-1]] += b[np.repeat(np.arange(len(counts)), counts)]
    stack = ExpertStack(DenseLinear(jnp.asarray(w), jnp.asarray(b)))
    assert experts_packable(stack)
    packed = PanelExpertStack.pack(stack)
    got = np.asarray(jax.jit(packed.grouped)(jnp.asarray(x), jnp.asarray(offsets)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not got[offsets[-1]:].any()


@needs_native
@pytest.mark.parametrize("offsets", [[0, 5, 3, 8], [1, 2, 3, 4], [0, 2, 4, 9]])
def test_grouped_linear_refuses_offsets_out_of_order_or_range(offsets):
    x = jnp.ones((8, 16), jnp.float32)
    with pytest.raises(Exception, match="offsets must"):
        np.asarray(grouped_linear(x, jnp.asarray(offsets, jnp.int32), jnp.ones((3, 1, 16, 16), jnp.float32)))
    with pytest.raises(ValueError, match=r"offsets \[E \+ 1\]"):
        grouped_linear(x, jnp.zeros(3, jnp.int32), jnp.ones((3, 1, 16, 16), jnp.float32))


@needs_native
def test_mixture_on_packed_experts_matches_numpy():
    """The layer as the engine runs it on a CPU with AVX-512: the params through to_panels (experts
    PanelExpertStack, their widths padded to a panel), one token (decode), 2, 32 (every expert
    chosen), one expert chosen by every token, and a padded batch (the padding routes nowhere)."""
    from paged_jax.models import moe
    from paged_jax.weights import DenseLinear
    from paged_jax.weights.panels import PanelExpertStack
    from paged_jax.weights.panels import to_panels

    E, k, H, I, S = 8, 2, 16, 12, 10
    rng = np.random.default_rng(0)
    router, gate_up, down, shared, shared_gate, params = random_moe(rng, E, H, I, S)
    cfg = moe.MoEConfig(E, k, I, True, (0,), shared_intermediate_size=S, shared_expert_gate=True)
    packed = to_panels(params)
    assert all(isinstance(packed[n], PanelExpertStack) for n in ("gate", "up", "down"))
    run = jax.jit(lambda p, x, real: moe.moe_mlp(p, cfg, x, real))
    biased = router.copy()
    biased[:, 4] += 50.0  # every token's first choice is expert 4
    for T, r in ((1, router), (2, router), (32, router), (24, biased)):
        x = rng.standard_normal((T, H)).astype(np.float32)
        if T == 32:
            assert len(np.unique(np.argsort(-(x @ r), axis=1)[:, :k])) == E
        p = dict(packed, router=to_panels(DenseLinear(jnp.asarray(r))))
        got = np.asarray(run(p, jnp.asarray(x), jnp.ones(T, bool)))
        want = numpy_moe(x, r, gate_up, down, k, "softmax", True, shared, shared_gate)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{T} tokens")
    x = np.concatenate([rng.standard_normal((17, H)), np.repeat(rng.standard_normal((1, H)), 7, axis=0)]).astype(np.float32)
    got = np.asarray(run(packed, jnp.asarray(x), jnp.asarray(np.arange(24) < 17)))
    np.testing.assert_allclose(got[:17], numpy_moe(x[:17], router, gate_up, down, k, "softmax", True, shared,
                                                   shared_gate), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got[17:], numpy_moe(x[17:], router, gate_up, 0 * down, k, "softmax", True, shared,
                                                   shared_gate), rtol=2e-5, atol=2e-5)
    assert "linear grouped float32" in native.status()["traced"]


OTHER_BUILD_CHECK = """
import json, jax, jax.numpy as jnp, numpy as np
from paged_jax import native
from paged_jax.native.grouped import grouped_linear
from tests.test_moe_grouped import CASES, grouped_case, pack
assert native.available(), native.status()
errors = []
for counts, K, N, past in CASES:
    x, w, offsets, want = grouped_case(np.random.default_rng(len(counts) + K), counts, K, N, past)
    got = np.asarray(jax.jit(grouped_linear)(jnp.asarray(x), jnp.asarray(offsets), pack(w)))
    errors.append(float(np.max(np.abs(got - want) / (1e-5 * np.sqrt(K) + 1e-5 * np.abs(want)), initial=0)))
print(json.dumps({"status": native.status(), "errors": errors}))
"""


@pytest.mark.slow  # builds the library again (about a minute)
@pytest.mark.parametrize("flags", ["-mno-avx512f", PORTABLE_FLAGS])
def test_grouped_linear_other_builds(tmp_path_factory, flags):
    """The AVX2 tiles (6-row tiles, 16-column strips) and the portable loops: the same numpy oracle."""
    out = run_build(OTHER_BUILD_CHECK, tmp_path_factory, f"test_moe_grouped.py::other_builds[{flags}]", flags)
    assert "linear grouped float32" in out["status"]["traced"]
    assert max(out["errors"]) <= 1, out["errors"]
