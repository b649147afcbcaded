"""Expert parallelism's two exchanges side by side in one run, on forced CPU devices: one MoE layer
(router included, jitted) with its experts split over N devices, the tokens brought to them by
``"gather"`` (every device runs its own experts' pairs of the replicated tokens, one all-reduce) or
``"all_to_all"`` (each device routes its 1/N of the tokens, rows exchanged both ways, an all-gather);
beside them the same layer on one device. Also the bytes each exchange moves per device.

    python experiments/bench_expert_parallel.py [--devices 2] [--experts 8] [--top-k 2] [--hidden 512]
                                               [--expert-width 1024] [--batches 1 8 32 128] [--repeats 7]

The devices are the host's threads (XLA_FLAGS=--xla_force_host_platform_device_count, set here before
JAX starts), so the collectives are memory copies between threads on the same cores: the figures say
which exchange does less work here, not what a network would cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-width", type=int, default=1024)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    if "jax" in sys.modules:
        raise RuntimeError("JAX was imported before the device count was set")
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import bench_common  # noqa: F401  (puts this checkout on the path)
    from paged_jax.models import moe
    from paged_jax.models.moe_experts import expert_mesh, grouped_experts, split_experts
    from paged_jax.weights import DenseLinear, ExpertStack

    E, k, H, I, n = a.experts, a.top_k, a.hidden, a.expert_width, a.devices
    cfg = moe.MoEConfig(E, k, I, renormalize=True, sparse_layers=(0,))
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((n,), ("tp",), axis_types=(AxisType.Auto,))
    weights = {"gate": (E, H, I), "up": (E, H, I), "down": (E, I, H)}
    weights = {name: jnp.asarray(0.05 * rng.standard_normal(shape), jnp.float32) for name, shape in weights.items()}
    router = jnp.asarray(rng.standard_normal((H, E)), jnp.float32)
    one = {name: ExpertStack(DenseLinear(w)) for name, w in weights.items()}
    split = {name: ExpertStack(DenseLinear(jax.device_put(w, NamedSharding(mesh, P("tp"))))) for name, w in weights.items()}
    router_split = jax.device_put(router, NamedSharding(mesh, P()))

    def layer(exchange):
        def run(x, r, stacks):
            w, ids = moe.route(x @ r, cfg)
            if exchange is None:
                return grouped_experts(x, w, ids, stacks)
            return split_experts(expert_mesh(stacks), x, w, ids, stacks, exchange=exchange)
        return jax.jit(run)

    variants = {"one device": (layer(None), router, one), "gather": (layer("gather"), router_split, split),
                "all_to_all": (layer("all_to_all"), router_split, split)}
    print(f"one MoE layer, {E} experts top-{k}, hidden {H}, expert width {I}, float32, {n} forced CPU devices "
          f"({E // n} experts each); median ms of {a.repeats} rounds, the variants in turn")
    print(f"{'tokens':>6} " + " ".join(f"{v:>12}" for v in variants) + "   all_to_all/gather"
          "   bytes/device: all-reduce  all-to-all+gather")
    for T in a.batches:
        x = jnp.asarray(0.5 * rng.standard_normal((T, H)), jnp.float32)
        xs = jax.device_put(x, NamedSharding(mesh, P()))
        outs = {v: np.asarray(f(x if v == "one device" else xs, r, s)) for v, (f, r, s) in variants.items()}
        for v in ("gather", "all_to_all"):
            np.testing.assert_allclose(outs[v], outs["one device"], rtol=1e-4, atol=1e-4)
        times = {v: [] for v in variants}
        for _ in range(a.repeats):
            for v, (f, r, s) in variants.items():
                arg = x if v == "one device" else xs
                t = time.perf_counter()
                for _ in range(5):
                    f(arg, r, s).block_until_ready()
                times[v].append((time.perf_counter() - t) / 5 * 1e3)
        ms = {v: statistics.median(t) for v, t in times.items()}
        # a ring all-reduce sends 2 (n - 1) / n of the array; the all-to-all sends its buffer (T/n x k rows per
        # destination, the worst case) out and back, (n - 1) / n of it off the device, and the all-gather (n - 1) / n
        t_local = -(-T // n)
        reduce = 2 * (n - 1) / n * T * H * 4
        exchange = 2 * (n - 1) * t_local * k * H * 4 + (n - 1) / n * T * H * 4
        print(f"{T:>6} " + " ".join(f"{ms[v]:>12.3f}" for v in variants) +
              f"   {ms['all_to_all'] / ms['gather']:>17.2f}   {reduce / 1e3:>21.1f} kB {exchange / 1e3:>15.1f} kB")


if __name__ == "__main__":
    main()
