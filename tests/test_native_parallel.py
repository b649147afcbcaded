"""The native kernels' helper threads (paged_jax/native/parallel.h): a team that spins for a bounded
time after each call so that a step's small calls find the second core awake, and XLA's pool for a
call that finds the team busy. Run in a child process, so that its team is fresh and its exit and
idle CPU time are its own: two threads calling kernels at once get, call by call, the bits the same
calls gave one at a time (themselves checked against numpy); an idle process burns no CPU once the
spin is over; the process exits at once while the helpers spin."""

import json
import subprocess
import sys
import textwrap

import pytest

from paged_jax import native

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels not built: {native.status()}")

CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import jax, jax.numpy as jnp, numpy as np
    from paged_jax import native

    assert native.available(), native.status()
    rng = np.random.default_rng(0)
    K, N, CALLS = 512, 1536, 8  # 32 panels: several ranges a call, so the helpers take part
    w = rng.standard_normal((K, N)).astype(np.float32) / 16
    values = rng.integers(0, 256, size=(K // 2, N), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(K // 32, N)).astype(np.float32)
    w_panels = native.pack_weight(jnp.asarray(w))
    q_panels, s_panels = native.pack_int4_blocks(jnp.asarray(values)), native.pack_padded(jnp.asarray(scales))

    @jax.jit
    def chain(x):  # CALLS dependent calls of each kernel, outputs of every call kept
        outs = []
        for _ in range(CALLS):
            y = native.linear(x, w_panels)
            z = native.linear_int4(x, q_panels, s_panels)[:, :N]
            outs += [y, z]
            x = jnp.tanh(y[:, :K] + z[:, K:2 * K])
        return jnp.stack(outs)

    xs = [rng.standard_normal((1, K)).astype(np.float32) for _ in range(6)]
    alone = [np.asarray(chain(x)) for x in xs]
    oracle_error = float(np.abs(alone[0][0] - xs[0] @ w).max() / np.abs(xs[0] @ w).max())

    mismatches = []
    def caller(t):
        for r in range(40):
            i = (t * 3 + r) % len(xs)
            if not np.array_equal(np.asarray(chain(xs[i])), alone[i]):
                mismatches.append((t, r))
    threads = [threading.Thread(target=caller, args=(t,)) for t in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]

    time.sleep(1.0)  # past the helpers' spin (and XLA's pool settling; a loaded machine stretches both)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(1.0)
    idle_cpu = (time.process_time() - cpu) / (time.perf_counter() - wall)
    jax.block_until_ready(chain(xs[0]))  # exit with the helpers spinning
    print(json.dumps({"mismatches": mismatches, "oracle_error": oracle_error, "idle_cpu": idle_cpu}))
""")


@needs_native
def test_concurrent_calls_equal_calls_alone_and_an_idle_process_exits_at_once():
    """Two threads, 40 steps each of 16 kernel calls, every output equal to the bit to the same step
    run alone; the float32 matmul alone equals numpy's to float32 rounding; idle, the process uses
    under 5 % of a core (a helper spinning on would be 100 %); it exits at once, helpers spinning
    (the 60 s timeout is for a hang)."""
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["mismatches"] == []
    assert out["oracle_error"] < 1e-5
    assert out["idle_cpu"] < 0.05, out
