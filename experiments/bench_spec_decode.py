"""Speculative decoding with n-gram (prompt lookup) drafts against plain decoding, side by side.

    python experiments/bench_spec_decode.py [--workloads complete,edit] [--batches 1] [--ks 2,4,8]

The default model (``paged_jax/models/data/default-model``, trained on the Python standard library)
writes code, greedy (or sampled at ``--temperature``, seed 0), ``--output-len`` tokens (EOS ignored, so every configuration generates the same
number of tokens). Workloads: ``complete`` continues the first ``--prompt-chars`` characters of a
held-out standard-library file (``experiments/stdlib_corpus.py``); ``edit`` gives that text followed
by its first eighth again, so that the continuation mostly repeats code the prompt holds (what
rewriting or editing shown code is like, and where prompt lookup is meant to pay). One engine per
configuration, all in this process: plain decoding, and n-gram speculation with
``num_speculative_tokens`` k for each of ``--ks`` (``prompt_lookup_min`` / ``prompt_lookup_max``
from the flags). Each engine first runs the whole workload once (compiling its shapes). Then,
``--rounds`` times, each batch of ``batch`` prompts runs under every configuration in turn, the
order rotating, so that a burst of load from elsewhere falls on all alike; a batch's time is its
best round (a shared machine only slows a run down), a configuration's tokens/s is the tokens over
the sum of its batches' times. It prints tokens/s, the ratio to plain decoding, the acceptance rate
(accepted / draft tokens), the mean acceptance length (tokens per target step of a drafted row: 1 +
accepted / drafts), the engine steps of a round, the target's forward passes in them (more than the
steps where a step was split in two) and the milliseconds a step (the ratio to plain decoding is the
product of the steps saved and the cost of a step), and the seconds spent proposing
(each batch's best round) and per step, and checks that every configuration's tokens equal plain decoding's
(sampled drafts of a draft model give other tokens, with the same distribution: NO is expected there).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import this checkout's paged_jax and experiments
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "proposal_time")


def code_prompts(count: int, chars: int, workload: str) -> list[str]:
    """``complete``: the start of a held-out file, to continue. ``edit``: that start, then its first
    eighth again (as when a model rewrites code it was shown: the continuation mostly copies)."""
    from experiments.stdlib_corpus import read, split

    _, held = split()
    prompts = []
    for path in held:
        text = read(path)
        if len(text) >= chars:
            text = text[:chars]
            prompts.append(text if workload == "complete" else text + "\n\n" + text[:chars // 8])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"only {len(prompts)} held-out files have {chars} characters")


def run(llm, prompts: list[str], batch: int, params) -> tuple[float, list[list[int]]]:
    """Seconds to complete the prompts ``batch`` at a time, and the tokens generated."""
    t0, tokens = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return time.perf_counter() - t0, tokens


def count_calls(fn, counts: dict, name: str):
    """``fn``, counting its calls in ``counts[name]``."""

    def counted(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return counted


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes")
    ap.add_argument("--ks", default="2,4,8", help="comma-separated num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=4)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-chars", type=int, default=1200)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; else sampled at this temperature, seed 0 (a draft model's drafts are then sampled "
                         "from its q and verified by rejection sampling: its tokens are not plain decoding's)")
    ap.add_argument("--workloads", default="complete,edit", help="complete and/or edit (see code_prompts)")
    ap.add_argument("--draft-model", default=None,
                    help="also a draft-model configuration per k with this model folder as the draft ('default': "
                         "the default model itself, acceptance's upper bound at a draft as costly as the target)")
    ap.add_argument("--disable-by-batch-size", default="default",
                    help="comma-separated disable_by_batch_size values, one n-gram configuration per k for each: a "
                         "number, 'none' (speculate at every batch size) or 'default' (the engine's default)")
    a = ap.parse_args(argv)

    from paged_jax import LLM, SamplingParams

    batches = [int(b) for b in a.batches.split(",")]
    ks = [int(k) for k in a.ks.split(",")]
    params = SamplingParams(temperature=a.temperature, seed=0 if a.temperature else None, max_tokens=a.output_len,
                            ignore_eos=True)
    configs = {"plain": None}
    offs = a.disable_by_batch_size.split(",")
    for off in offs:
        for k in ks:
            name = f"ngram k={k}" + (f" off@{off}" if len(offs) > 1 else "")
            configs[name] = {"method": "ngram", "num_speculative_tokens": k,
                             "prompt_lookup_min": a.lookup_min, "prompt_lookup_max": a.lookup_max}
            if off != "default":
                configs[name]["disable_by_batch_size"] = None if off == "none" else int(off)
    if a.draft_model:
        from paged_jax.models.tiny import default_model_path

        draft = str(default_model_path()) if a.draft_model == "default" else a.draft_model
        for k in ks:
            configs[f"draft k={k}"] = {"model": draft, "num_speculative_tokens": k}
    engines = {name: LLM(max_model_len=1024, max_num_seqs=max(batches), num_kv_blocks=64 * max(batches) + 1,
                         speculative_config=spec) for name, spec in configs.items()}
    passes = dict.fromkeys(configs, 0)  # the target's forward passes (a step split in two counts two)
    for name, llm in engines.items():
        llm.llm_engine.runner.run_step = count_calls(llm.llm_engine.runner.run_step, passes, name)
    print(f"{a.prompts} code prompts ({a.prompt_chars} characters of held-out standard-library files), "
          f"{a.output_len} tokens each, {'temperature %g, seed 0' % a.temperature if a.temperature else 'greedy'}; n-gram lookup {a.lookup_min}-{a.lookup_max}; best of {a.rounds} rounds per batch")
    for workload, batch in [(w, b) for w in a.workloads.split(",") for b in batches]:
        prompts = code_prompts(a.prompts, a.prompt_chars, workload)
        batches_of = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        tokens, spec_stats = {}, {name: None for name in configs}
        for name, llm in engines.items():  # compile every shape this workload reaches
            _, tokens[name] = run(llm, prompts, batch, params)
        # Each batch of prompts runs under every configuration in turn (the order rotating), so a burst of
        # load from elsewhere hits all configurations alike; each batch's time is its best round.
        best = {name: [float("inf")] * len(batches_of) for name in configs}
        proposing = {name: [float("inf")] * len(batches_of) for name in configs}  # each batch's best round, too
        steps = dict.fromkeys(configs, 0)  # engine steps of the first round (the tokens are the same in each)
        round_passes = dict.fromkeys(configs, 0)  # and the target's forward passes
        for r in range(a.rounds):
            for b, chunk in enumerate(batches_of):
                names = list(configs)
                shift = (r + b) % len(names)
                for name in names[shift:] + names[:shift]:
                    llm = engines[name]
                    before, first_step = llm.llm_engine.get_stats()["spec_decode"], llm.llm_engine.num_steps
                    first_pass = passes[name]
                    seconds, _ = run(llm, chunk, batch, params)
                    steps[name] += (llm.llm_engine.num_steps - first_step) if r == 0 else 0
                    round_passes[name] += (passes[name] - first_pass) if r == 0 else 0
                    best[name][b] = min(best[name][b], seconds)
                    after = llm.llm_engine.get_stats()["spec_decode"]
                    if after is not None:
                        proposing[name][b] = min(proposing[name][b], after["proposal_time"] - before["proposal_time"])
                    if after is not None and r == 0:
                        prev = spec_stats[name] or dict.fromkeys(SPEC_KEYS, 0)
                        spec_stats[name] = {key: prev[key] + after[key] - before[key] for key in SPEC_KEYS}
        best = {name: sum(times) for name, times in best.items()}
        for name, s in spec_stats.items():
            if s is not None:  # the seconds spent proposing: each batch's best round
                s["proposal_time"] = sum(proposing[name])
        total = len(prompts) * a.output_len
        base = total / best["plain"]
        # tokens/s over plain = (plain's steps / these steps) x (plain's ms a step / these ms a step): what
        # acceptance gives and what a step with drafts costs.
        print(f"\n{workload}, batch {batch}:\n{'configuration':<22} {'tokens/s':>9} {'x plain':>8} {'accept':>7} "
              f"{'mean len':>9} {'steps':>6} {'passes':>7} {'ms/step':>8} {'propose s':>10} {'propose ms/step':>16} {'same tokens':>12}")
        for name in configs:
            tps = total / best[name]
            s = spec_stats.get(name)
            acc = f"{s['num_accepted_tokens'] / s['num_draft_tokens']:.2f}" if s and s["num_draft_tokens"] else "-"
            mean = f"{1 + s['num_accepted_tokens'] / s['num_drafts']:.2f}" if s and s["num_drafts"] else "-"
            prop = f"{s['proposal_time']:.3f}" if s else "-"
            prop_ms = f"{1000 * s['proposal_time'] / steps[name]:.2f}" if s else "-"
            same = "yes" if tokens[name] == tokens["plain"] else "NO"
            ms = 1000 * best[name] / steps[name]
            print(f"{name:<22} {tps:9.1f} {tps / base:8.2f} {acc:>7} {mean:>9} {steps[name]:6d} {round_passes[name]:7d} "
                  f"{ms:8.2f} {prop:>10} {prop_ms:>16} "
                  f"{same:>12}")


if __name__ == "__main__":
    main()
