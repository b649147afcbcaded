"""Cost of each BlockManager operation, in microseconds per call.

For ``--num-seqs`` requests (prompt ``--prompt-len`` tokens, ``--decode-steps``
decode tokens each): allocate, mark_blocks_computed, append_slot (decode), fork,
append_slot with copy-on-write (the forked child's first token), swap_out and
swap_in (each request = parent + child sharing blocks), free. Each number is
the minimum over ``--repeats`` runs. With prefix
caching, every prompt shares its first ``--shared-prefix`` tokens, so
allocations hit the cache.

    python experiments/bench_block_manager.py [--num-seqs 1000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable

from paged_jax.memory import BlockManager
from paged_jax.sequence import Sequence, SequenceGroup, SequenceStatus


def timed(fn: Callable, items: Iterable) -> float:
    """Microseconds per call of ``fn`` over ``items``."""
    items = list(items)
    start = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - start) / len(items) * 1e6


def run(args: argparse.Namespace, prefix_caching: bool) -> dict[str, float]:
    n, bs = args.num_seqs, args.block_size
    blocks_per_seq = -(-(args.prompt_len + args.decode_steps + 1) // bs) + 1
    bm = BlockManager(bs, num_gpu_blocks=(n + 1) * blocks_per_seq + 1, num_cpu_blocks=n * blocks_per_seq,
                      watermark=0.0, enable_prefix_caching=prefix_caching)
    shared = list(range(args.shared_prefix)) if prefix_caching else []

    def prompt(i: int) -> list[int]:
        return shared + [100_000 + i] * (args.prompt_len - len(shared))

    def compute(seq: Sequence) -> None:
        seq.num_computed_tokens = seq.get_len()
        bm.mark_blocks_computed(seq)

    warm = SequenceGroup("warm", [Sequence(-1, prompt(-1))])  # puts the shared prefix in the cache
    bm.allocate(warm)
    compute(warm.seqs[0])

    groups = [SequenceGroup(str(i), [Sequence(i, prompt(i))]) for i in range(n)]
    seqs = [g.seqs[0] for g in groups]
    res = {"allocate": timed(bm.allocate, groups)}
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
    res["mark_blocks_computed (prompt)"] = timed(compute, seqs)

    decode = mark = 0.0
    for step in range(args.decode_steps):
        for seq in seqs:
            seq.append_token_id(step)
        decode += timed(bm.append_slot, seqs)
        mark += timed(compute, seqs)
    res["append_slot (decode)"] = decode / args.decode_steps
    res["mark_blocks_computed (decode)"] = mark / args.decode_steps

    children = [seq.fork(n + i) for i, seq in enumerate(seqs)]
    res["fork"] = timed(lambda pair: bm.fork(*pair), zip(seqs, children))
    for group, child in zip(groups, children):
        group.add(child)
        child.append_token_id(1)
    res["append_slot (copy-on-write)"] = timed(bm.append_slot, children)

    res["swap_out (2 seqs sharing blocks)"] = timed(bm.swap_out, groups)
    for group in groups:
        for seq in group.seqs:
            seq.status = SequenceStatus.SWAPPED
    res["swap_in (2 seqs sharing blocks)"] = timed(bm.swap_in, groups)
    bm.check_invariants()
    res["free"] = timed(bm.free, seqs + children)
    bm.free(warm.seqs[0])
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == bm.gpu_allocator.num_total_blocks
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--shared-prefix", type=int, default=192)
    parser.add_argument("--decode-steps", type=int, default=15)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # The minimum over repeats: timings on a shared machine only get slower.
    plain, cached = ({op: min(r[op] for r in runs) for op in runs[0]}
                     for runs in ([run(args, caching) for _ in range(args.repeats)] for caching in (False, True)))
    print(f"{args.num_seqs} sequences, prompt {args.prompt_len} tokens, block size {args.block_size}, "
          f"{args.decode_steps} decode steps; prefix caching shares {args.shared_prefix} prompt tokens")
    print(f"{'operation':34s} {'us/op':>10s} {'us/op, prefix caching':>22s}")
    for op in plain:
        print(f"{op:34s} {plain[op]:10.2f} {cached[op]:22.2f}")


if __name__ == "__main__":
    main()
