"""Expert parallelism: a mixture's experts split over devices (whole experts to each), the tokens brought
to them by an all-reduce of every device's part ("gather") or by an all-to-all exchange.

The layer itself, both exchanges, against the numpy reference of tests/test_moe.py, runs in a process of
its own with 4 forced CPU devices (``python -m tests.test_expert_parallel``); the engine under tensor
parallelism, against transformers, is in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.host_devices import xla_flags_with_devices

ROOT = Path(__file__).resolve().parents[1]


def check_split_layer() -> None:
    """Both exchanges over 4 devices (2 experts each), the engine's over 2 (4 each: one token takes the
    few-token path on each device): one token, a batch whose padding is marked, and a batch
    whose tokens all pick one expert first (one device gets every token): equal to the numpy reference."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from paged_jax.models import moe
    from paged_jax.models.moe_experts import EXCHANGES, expert_mesh, split_experts
    from paged_jax.weights import DenseLinear, ExpertStack
    from tests.test_moe import numpy_moe

    E, k, H, I = 8, 2, 16, 12
    rng = np.random.default_rng(0)
    router = rng.standard_normal((H, E)).astype(np.float32)
    gate_up = (0.3 * rng.standard_normal((E, H, 2 * I))).astype(np.float32)
    down = (0.3 * rng.standard_normal((E, I, H))).astype(np.float32)
    biased = router.copy()
    biased[:, 6] += 50.0  # every token's first choice is expert 6
    cfg = moe.MoEConfig(E, k, I, True, (0,))
    for n, exchanges in ((4, EXCHANGES), (2, ("gather",))):
        mesh = jax.make_mesh((n,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
        split = NamedSharding(mesh, P("tp"))
        stacks = {"gate": gate_up[..., :I], "up": gate_up[..., I:], "down": down}
        stacks = {name: ExpertStack(DenseLinear(jax.device_put(jnp.asarray(w), split))) for name, w in stacks.items()}
        assert expert_mesh(stacks) is not None
        assert [s.data.shape for s in stacks["gate"].linear.w.addressable_shards] == [(E // n, H, I)] * n
        for exchange in exchanges:
            @jax.jit
            def run(stacks, r, x, real):
                weights, experts = moe.route(x @ r, cfg)
                return split_experts(expert_mesh(stacks), x, weights, experts, stacks, real=real, exchange=exchange)

            for T, r, n_real in ((1, router, 1), (23, router, 17), (24, biased, 24)):
                x = rng.standard_normal((T, H)).astype(np.float32)
                got = np.asarray(run(stacks, jnp.asarray(r), jnp.asarray(x), jnp.arange(T) < n_real))
                want = numpy_moe(x[:n_real], r, gate_up, down, k, "softmax", True)
                np.testing.assert_allclose(got[:n_real], want, rtol=2e-5, atol=2e-5,
                                           err_msg=f"{n} devices, {exchange}, {T} tokens")
                assert not got[n_real:].any(), "padding tokens went to an expert"


@pytest.mark.slow  # about 15 s; the engine's default exchange is checked against transformers by default
def test_split_experts_equal_the_numpy_reference():
    env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(4), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.test_expert_parallel"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "checked" in proc.stdout


def test_expert_stacks_split_on_their_expert_axis():
    """The stacked class declares its expert axis: whole experts to each device, float or quantized
    (every array of the stack split on its leading axis); a count the devices do not divide is refused."""
    import jax
    from jax.sharding import PartitionSpec as P

    from paged_jax.parallel import check_tensor_parallel
    from paged_jax.parallel.rules import weight_specs
    from paged_jax.weights import DenseLinear, ExpertStack, QuantizedLinear

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, "float32")

    dense = weight_specs(ExpertStack(DenseLinear(s(8, 16, 32), s(8, 32))), 4)
    assert (dense.linear.w, dense.linear.b) == (P("tp", None, None), P("tp", None))
    q = weight_specs(ExpertStack(QuantizedLinear(s(8, 8, 32), s(8, 1, 32), bits=4, in_features_=16)), 2)
    assert (q.linear.values, q.linear.scale) == (P("tp", None, None), P("tp", None, None))
    assert weight_specs(ExpertStack(DenseLinear(s(8, 16, 32)), parallel=None), 4).linear.w == P(None, None, None)

    from paged_jax.models import model_config_from_hf

    cfg = model_config_from_hf(dict(architectures=["MixtralForCausalLM"], vocab_size=32, hidden_size=64,
                                    intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=4, num_local_experts=6, num_experts_per_tok=2))
    assert check_tensor_parallel(cfg, 2)[0] == cfg
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide the model's 6 experts"):
        check_tensor_parallel(cfg, 4)


if __name__ == "__main__":
    check_split_layer()
    print("checked")
