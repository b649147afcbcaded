"""How a step's tokens run through a mixture's experts: on one device, sorted by expert and run as
one grouped matmul (:func:`grouped_experts`), or with the experts split over devices, each device
running its own (:func:`split_experts`).

Where the engine packs float32 weights for the native matmul (:func:`paged_jax.native.packs_weights`:
AVX-512 tiles, or AVX2 ones on a CPU without AVX-512) it stores float32 experts as
:class:`~paged_jax.weights.panels.PanelExpertStack` (column panels), and the step is the native
grouped matmul (``paged_jax/native/grouped_linear.cc``): the (token, expert) pairs sorted by
expert, exactly their rows (T x k, no window padding), every expert's segment over its own panels
with the float32 matmul's register tiles, one call per projection. Each chosen expert's weight is
streamed from memory once with the matmul's prefetching, and an expert no token chose is not read.
It is kept because at decode batch sizes the step is bound by reading the experts' weights (at 32
tokens, 8 experts top-2, every expert is chosen: every formulation reads all the weights), and the
panel kernel streams them faster than XLA's batched matmul (the windows below lose to it at 8 tokens,
where both do few rows); the windows also did E x C rows (C the largest segment rounded up, 16-24 at
32 tokens where the pairs average 8), the native kernel does the T x k. Measured side by side
(``python experiments/bench_moe.py``; see the README's figures): against the dense all-experts
batched matmul about 3x at 32 tokens, where the windows gave 1.3-1.4x. Gate and up stay two calls
(a fused gate|up stack was not tried: it would save one call per layer, and the checkpoint's
separate stacks would need joining for every weight format).

The experts are :class:`~paged_jax.weights.experts.ExpertStack` weights ``gate``, ``up`` ``[E, H, I]``
and ``down`` ``[E, I, H]`` (float or quantized: each stack runs its class's own matmul).

Elsewhere (quantized or half-precision experts, a GPU, float32 left to XLA, tensor parallelism): the
step's (token, expert) pairs are sorted by expert, and every expert multiplies a window of the sorted
rows that starts at its own segment, all experts in one batched matmul against the stacked weights
(``[E, C, H] @ [E, H, I]``). The window size C is the step's largest segment
rounded up a ladder of sizes (1, 2, 4, 8, 16, 24, 32, 48, ...), chosen at run time by ``lax.switch``;
rows of a window past its expert's segment are masked out, and the results are added back to their
tokens. So the work is E x C rows where the dense all-experts formulation does E x T, and no weights
are copied. A step of a few tokens (at most E / 2k: decoding one or two sequences) instead runs only
the experts chosen, each behind a ``lax.cond``, so the others' weights are not even read.

Measured side by side on this project's CPU (``experiments/bench_moe.py``: 8 experts, top-2, hidden
512, expert width 1024, float32, weights passed as arguments as the engine passes params; 2 shared,
noisy cores, so runs differ by tens of percent), against the dense all-experts batched matmul this ran
1.1-1.7x as fast at 32 tokens, about 2.1x at 128, 1.3-2.3x at one token, and about even at 4-8 tokens
(where every expert is chosen and all weights are read either way). The alternatives lost:
``jax.lax.ragged_dot`` ran 6-20x *slower* than this (on the CPU XLA lowers it to one dense matmul over
all groups with masked inputs, after copying the whole weight into a new layout), and a loop over the
experts, each on its own window, ran about as slow as the dense matmul (each iteration copied its
expert's weight slice). On a GPU, where ``ragged_dot`` is a grouped GEMM and each ``lax.switch`` or
``lax.cond`` reads its branch index back to the host, the balance may differ: measure there.

Expert parallelism: under tensor parallelism the stacks are split on their expert axis (whole experts
to each device, :mod:`paged_jax.parallel.rules`), and the hidden states are the same on every device
(Megatron's layers all-reduce them). Two ways to bring tokens and experts together, both here:

- ``"gather"`` (what the engine runs): every device already holds every token, so each runs the step's
  pairs that chose its own experts (the rest sort past its last segment) and one all-reduce of
  ``[T, H]`` sums the devices' parts;
- ``"all_to_all"``: each device routes its 1/N of the tokens, sends each (token, expert) pair's row to
  the device holding the expert (a buffer of ``T/N x k`` rows per destination: no pair may be dropped,
  so capacity is the worst case), runs what it received, sends the results back, and an all-gather
  rebuilds the hidden states.

The all-to-all moves about 2.5x the bytes of the all-reduce here (rows go out and come back, one per
chosen expert, padded to the worst case) and does the same expert work, so it can only pay where the
tokens are not already on every device (data-parallel attention, many hosts). Measured side by side
(``experiments/bench_expert_parallel.py``, 8 experts top-2, hidden 512, width 1024, float32, forced CPU
devices on 2 shared cores): all_to_all / gather 1.05-2.2x the time with 2 devices and 1.05-1.9x with 4,
over 1 to 128 tokens; gather never lost.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EXCHANGES = ("gather", "all_to_all")


def window_sizes(num_rows: int) -> list[int]:
    """The ladder of window sizes the largest segment is rounded up to: 1, 2, 4, 8, then two sizes per
    doubling (16, 24, 32, 48, 64, 96, ...), and last ``num_rows`` (the most one expert can get: each
    token picks it at most once)."""
    sizes, s = [], 1
    while s < min(num_rows, 8):
        sizes.append(s)
        s *= 2
    s = 8
    while s < num_rows:
        sizes.append(s)
        s = s * 3 // 2 if (s & (s - 1)) == 0 else s * 4 // 3  # a power of two, then 1.5 times one
    return sizes + [num_rows]


def swiglu(p, xs, act=jax.nn.silu, glu=None):
    """``down(act(gate(xs)) * up(xs))``; ``p``: the three stacks (``xs [E, rows, H]``) or one expert's
    three weights (``xs [rows, H]``). With a ``glu`` (gpt-oss's clamped SwiGLU), ``gate`` is the fused
    gate-and-up projection and there is no ``up``: ``down(glu(gate(xs)))``."""
    if glu is not None:
        return p["down"](glu(p["gate"](xs)))
    return p["down"](act(p["gate"](xs)) * p["up"](xs))


def grouped_experts(x, weights, experts, p, act=jax.nn.silu, real=None, glu=None):
    """Each token's weighted sum over its chosen experts' SwiGLU MLPs, by sort-and-segment; float32.

    x ``[T, H]``; weights, experts ``[T, k]`` (an expert id of E or more: no expert); ``p``: the
    stacks ``gate``, ``up``, ``down``; ``real`` ``[T]`` bool: the step's real tokens (the others,
    the batch's padding, go to no expert and get 0)."""
    T, k = experts.shape
    E = p["gate"].num_experts
    experts = jnp.minimum(experts, E)
    if real is not None:  # padding sorts after every expert's segment and counts for none
        experts = jnp.where(real[:, None], experts, E)

    def mlp(p, xs, weight):  # [..., rows, H] -> [..., rows, H] float32, times each row's weight
        return swiglu(p, xs, act, glu).astype(jnp.float32) * weight[..., None]

    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token = (order // k).astype(jnp.int32)
    counts = jnp.bincount(flat, length=E + 1)[:E]
    starts = jnp.cumsum(counts) - counts

    if all(hasattr(s, "grouped") for s in p.values()):  # the native grouped matmul: exactly the pairs' rows
        offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
        rows = x[token]  # pairs of no expert sort past offsets[E]: the kernel gives them 0
        gate = p["gate"].grouped(rows, offsets)
        h = act(gate) * p["up"].grouped(rows, offsets) if glu is None else glu(gate)
        y = p["down"].grouped(h, offsets) * weights.reshape(-1)[order].astype(jnp.float32)[:, None]
        return jnp.zeros(x.shape, jnp.float32).at[token].add(y)
    sizes = window_sizes(T)
    pad = sizes[-1]  # a window starting at the last segment may run past the end: padding rows
    rows = jnp.concatenate([x[token], jnp.zeros((pad, x.shape[1]), x.dtype)])
    row_weight = jnp.concatenate([weights.reshape(-1)[order], jnp.zeros((pad,), weights.dtype)])
    row_token = jnp.concatenate([token, jnp.zeros((pad,), jnp.int32)])

    if 2 * T * k <= E:  # a few tokens (decoding a few sequences): only the experts they chose read their weights
        def expert(e, out):
            def run(out):
                at = starts[e] + jnp.arange(T)
                y = mlp({n: s[e] for n, s in p.items()}, rows[at], row_weight[at])
                mine = jnp.arange(T) < counts[e]
                return out.at[row_token[at]].add(jnp.where(mine[:, None], y, 0.0))
            return jax.lax.cond(counts[e] > 0, run, lambda out: out, out)

        out = jnp.zeros(x.shape, jnp.float32)
        for e in range(E):  # unrolled: a static slice of the weights, read only when the expert runs
            out = expert(e, out)
        return out

    def windows(size):
        def run():
            at = starts[:, None] + jnp.arange(size)[None, :]  # [E, size]: each expert's window of sorted rows
            y = mlp(p, rows[at], row_weight[at])  # one batched matmul, no weight copies
            mine = jnp.arange(size)[None, :] < counts[:, None]  # rows past the segment: the next expert's
            y = jnp.where(mine[..., None], y, 0.0).reshape(-1, x.shape[1])
            return jnp.zeros(x.shape, jnp.float32).at[row_token[at].reshape(-1)].add(y)
        return run

    branch = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), jnp.max(counts))  # the smallest that holds all
    return jax.lax.switch(branch, [windows(s) for s in sizes])


# --- experts split over devices ----------------------------------------------------------------


def expert_mesh(p):
    """The 1-D device mesh the stacks are split over (their expert axis, as the sharding rules place
    them under tensor parallelism), or None on one device. Read from the arrays' own placement, so
    model code needs no mesh passed in."""
    mesh = jax.typeof(jax.tree.leaves(p["gate"])[0]).sharding.mesh
    if len(mesh.axis_names) != 1 or mesh.shape[mesh.axis_names[0]] == 1:
        return None
    if p["gate"].num_experts % mesh.shape[mesh.axis_names[0]]:  # refused up front (check_tensor_parallel)
        raise ValueError(f"{p['gate'].num_experts} experts do not split over {mesh.shape} devices")
    return mesh


def split_experts(mesh, x, weights, experts, p, act=jax.nn.silu, real=None, exchange: str = "gather", glu=None):
    """:func:`grouped_experts` with the stacks split over ``mesh`` (each device holds E / N whole
    experts), the tokens brought to them by ``exchange`` (:data:`EXCHANGES`; see the module's notes)."""
    from jax.sharding import PartitionSpec as P

    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    axis = mesh.axis_names[0]
    n = mesh.shape[axis]
    local = p["gate"].num_experts // n
    real = jnp.ones(x.shape[0], bool) if real is None else real
    stacks = jax.tree.map(lambda _: P(axis), p)

    def gather(x, weights, experts, real, p):
        first = jax.lax.axis_index(axis) * local
        mine = (experts >= first) & (experts < first + local)
        out = grouped_experts(x, weights, jnp.where(mine, experts - first, local), p, act, real, glu)
        return jax.lax.psum(out, axis)

    def all_to_all(x, weights, experts, real, p):  # this device's T / n tokens
        t, k = experts.shape
        dest = jnp.where(real[:, None], experts // local, n).reshape(-1)  # padding: sent nowhere
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=n + 1)[:n]
        rank = jnp.arange(t * k) - (jnp.cumsum(counts) - counts)[jnp.minimum(dest[order], n - 1)]
        slot = jnp.zeros(t * k, jnp.int32).at[order].set(rank.astype(jnp.int32))  # each pair's row at its device
        sent = dest < n
        at = (jnp.where(sent, dest, 0), jnp.where(sent, slot, t * k))  # out of range: dropped by the scatters
        rows = jnp.zeros((n, t * k, x.shape[1]), x.dtype).at[at].set(jnp.repeat(x, k, axis=0), mode="drop")
        ids = jnp.full((n, t * k), local, jnp.int32).at[at].set(experts.reshape(-1) % local, mode="drop")
        rows = jax.lax.all_to_all(rows, axis, 0, 0, tiled=True)  # [n sources, t * k, H]
        ids = jax.lax.all_to_all(ids, axis, 0, 0, tiled=True)
        y = grouped_experts(rows.reshape(-1, x.shape[1]), jnp.ones((n * t * k, 1), jnp.float32),
                            ids.reshape(-1, 1), p, act, glu=glu)
        y = jax.lax.all_to_all(y.reshape(n, t * k, -1), axis, 0, 0, tiled=True)  # back to the senders
        back = y[at[0], jnp.minimum(at[1], t * k - 1)] * jnp.where(sent, weights.reshape(-1), 0.0)[:, None]
        out = back.reshape(t, k, -1).sum(axis=1)
        return jax.lax.all_gather(out, axis, tiled=True)

    if exchange == "gather":
        return jax.shard_map(gather, mesh=mesh, in_specs=(P(), P(), P(), P(), stacks), out_specs=P(),
                             check_vma=False)(x, weights, experts, real, p)
    T = x.shape[0]
    pad = -T % n  # the tokens split evenly over the devices; padding rows are not real
    padded = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (x, weights, experts, real)]
    out = jax.shard_map(all_to_all, mesh=mesh, in_specs=(P(axis), P(axis), P(axis), P(axis), stacks),
                        out_specs=P(), check_vma=False)(*padded, p)
    return out[:T]
