"""Per-sample seeds, in plain Python (no JAX): the engine derives them above the executor
border, the sampler turns them into PRNG keys (see ``paged_jax.sampler``)."""

from __future__ import annotations

M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def seed_for_sample(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` (0 .. best_of-1) of a request seeded with
    ``seed``: the seed itself for sample 0 (so ``n == 1`` uses the request seed
    as is), a 64-bit mix of both for the others (so samples differ)."""
    if sample_index == 0:
        return seed
    return splitmix64((seed & M64) ^ splitmix64(sample_index))
