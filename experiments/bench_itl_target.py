"""A latency target against fixed token budgets: streams decoding while long prompts prefill and short
prompts keep arriving.

    python experiments/bench_itl_target.py [--long 4000 16000] [--streams 16] [--budgets 64 ... 4096]
                                           [--multiples 2 5 25] [--stream-tokens 128] [--quick]

The model is ``bench_long_prompt.py --stutter``'s (GPT-2-shaped: 512 wide, 8 layers, vocabulary 1,024,
random float32). The scenario, on one engine: ``--streams`` greedy requests (32-token prompts) decode,
each replaced by a fresh one after ``--stream-tokens`` tokens (default 128; 0: never), so that their
decode step stays what it was measured at (a stream decoding for the whole window would reach over a
thousand tokens of context, and its decode step several times the one measured at the start);
after ``--before-steps`` steps the ``--long`` prompts arrive together, a short prompt (uniform 32 to 256
tokens, 8 output tokens) right behind them and another every ``--short-every`` seconds until the last long
prompt has its first token (``--short-every 0``: no short prompts). The first short prompt comes with the
long ones so that every run, however fast the machine, sees one arrive while they prefill. One process, side by side:

- **fixed budgets** (``max_num_batched_tokens`` of ``--budgets``, no target, FCFS): what a vLLM user tunes;
- **target k x** (``target_itl_ms`` = k times the decode step measured in the first run: the median
  step of the streams alone), each k of ``--multiples``, with the default policy under a target
  (short prompts first); and target ``--fcfs-multiple`` x with FCFS, to show what the policy adds.

Each engine is warmed up first (``warm_up``: step shapes compiled; with a target, the cost model
calibrated); the scenario runs once (``--runs``), and the compilations during it are counted. Printed per
configuration: the streams' p50 / p99 / max gap while the long prompts prefill (from their arrival to the
last one's first token; within one stream: a new stream's first token is not a gap; in ms and over the
target), the decode step at the start and at the end (the median step of the streams alone before the
long prompts arrive and after every prompt has its first token), each long prompt's time to first token, the short
prompts' p50 / p99 time to first token (from their arrival; those still waiting when the window ends
run on to their first token) and over a short prompt's time alone (the
median of three alone on the engine with the default budget, 256), the tokens computed per second over that window, the cost
model's median prediction error. ``--figure`` (default ``experiments/figures/itl_target.png``) draws the
longest prompt's time to first token against the p99 gap: fixed budgets as a curve, targets as points;
the rows go to the ``.json`` beside it. Engines hold at most ``--max-num-seqs`` (64) sequences. ``--quick``: a tiny model and short prompts (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import bench_common  # noqa: F401  (puts this checkout on the path)
from bench_long_prompt import STUTTER_MODEL

FIGURE = Path(__file__).resolve().parent / "figures" / "itl_target.png"
QUICK = dict(model=dict(family="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4), long=[300, 600], streams=4,
             budgets=[64, 512], multiples=[5], fcfs_multiple=None, before_steps=4, short_every=0.05, short_max=64,
             stream_tokens=32)


def scenario(engine, a, rng, tag: str, clock=time.perf_counter) -> dict:
    """Streams decode, the long prompts arrive, short ones follow; returns gaps, first-token times, tokens.
    ``clock``: seconds (the simulator's clock in ``notebooks/latency_target.ipynb``).

    Each stream generates at most ``a.stream_tokens`` tokens and is then replaced by a fresh one (a new
    32-token prompt), as a serving workload's streams come and go: their decode step stays what it was
    measured at instead of growing with their contexts. The first streams stop after 1/k, 2/k, ... of
    ``stream_tokens`` (k streams), so that replacements come one at a time, not all in one step. A gap
    is measured within one stream (a new stream's first token is not a gap). The decode step is the
    median step of the streams alone before the long prompts arrive and again after every prompt
    has its first token."""
    import numpy as np

    from paged_jax import SamplingParams

    vocab = engine.vocab_size
    greedy = dict(temperature=0, ignore_eos=True)
    per_stream = getattr(a, "stream_tokens", None)  # None or 0: the streams decode to the end
    live, ids, born = {}, {}, [0]  # request id -> stream slot; slot -> request id; streams started

    def start_stream(slot: int, max_tokens: int) -> None:
        rid = f"{tag}-s{slot}.{born[0]}"
        born[0] += 1
        engine.add_request(rid, None, SamplingParams(max_tokens=max_tokens, **greedy), rng.integers(3, vocab, 32).tolist())
        live[rid], ids[slot] = slot, rid

    for i in range(a.streams):
        start_stream(i, max(2, per_stream * (i + 1) // a.streams) if per_stream else 100_000)
    longs = {f"{tag}-long{n}": rng.integers(3, vocab, n).tolist() for n in a.long}
    counts, last, arrival, first = {}, {}, {}, {}
    gaps, decode_steps, end_steps, shorts, phase, before_left = [], [], [], [], "start", a.before_steps
    t_add = next_short = None
    steps0 = gen0 = born0 = None
    while True:
        now = clock()
        if phase == "start" and all(counts.get(rid, 0) >= 2 for rid in ids.values()):
            phase = "before"
        if phase == "before" and before_left == 0:
            for rid, p in longs.items():
                engine.add_request(rid, None, SamplingParams(max_tokens=1, **greedy), p)
                arrival[rid] = now
            # The first short prompt right behind the long ones; none at all for --short-every 0.
            t_add, next_short, phase = now, now if a.short_every > 0 else float("inf"), "during"
            steps0, gen0, born0 = engine.num_steps, engine.num_generated_tokens, born[0]
        while phase == "during" and next_short <= now:  # arrivals due by now, each at its own time
            rid = f"{tag}-short{len(shorts)}"
            prompt = rng.integers(3, vocab, int(rng.integers(32, a.short_max + 1))).tolist()
            engine.add_request(rid, None, SamplingParams(max_tokens=8, **greedy), prompt)
            arrival[rid], next_short = next_short, next_short + a.short_every
            shorts.append((rid, len(prompt)))
        t0 = clock()
        outs = engine.step()
        t1 = clock()
        if phase == "before":
            decode_steps.append(t1 - t0)
            before_left -= 1
        elif phase == "end":
            end_steps.append(t1 - t0)
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if o.request_id in live and n > counts.get(o.request_id, 0):
                counts[o.request_id] = n
                if phase == "during" and o.request_id in last:
                    gaps.append(t1 - last[o.request_id])
                last[o.request_id] = t1
                if o.finished:  # the stream is done: a fresh one takes its place
                    start_stream(live.pop(o.request_id), per_stream)
            elif o.request_id in arrival and n and o.request_id not in first:
                first[o.request_id] = t1 - arrival[o.request_id]
        if phase == "during" and all(rid in first for rid in longs):
            # The window ends: the streams' gaps and the throughput are measured up to here; the short
            # prompts that arrived keep running to their first tokens (no more arrive).
            window, phase = clock() - t_add, "after"
            served_in_window = [n for rid, n in shorts if rid in first]
            tokens = (sum(map(len, longs.values())) + sum(served_in_window) + 32 * (born[0] - born0)
                      + engine.num_generated_tokens - gen0)
            window_steps = engine.num_steps - steps0
        if phase == "after" and all(rid in first for rid, _ in shorts):
            engine.abort_request([rid for rid, _ in shorts])  # their first tokens are all they are here for
            phase, end_left = "end", a.before_steps
        elif phase == "end":
            end_left -= 1
            if end_left <= 0:
                break
    engine.abort_request(list(live) + [rid for rid, _ in shorts])
    while engine.has_unfinished_requests():
        engine.step()
    short_ttft = [first[rid] for rid, _ in shorts]
    # Tokens/s over the window: the long prompts, the short ones that got their first token in it, the
    # prompts of the streams started in it, every token generated (streams and short prompts).
    return dict(decode_step_s=float(np.median(decode_steps)), decode_step_end_s=float(np.median(end_steps)),
                gaps_s=[float(np.percentile(gaps, q)) for q in (50, 99)],
                max_gap_s=max(gaps), long_ttft_s={n: first[rid] for n, rid in zip(a.long, longs)},
                short_ttft_s=[float(np.percentile(short_ttft, q)) for q in (50, 99)] if short_ttft else None,
                num_shorts=len(shorts), num_shorts_in_window=len(served_in_window), window_s=window,
                tokens_per_s=tokens / window, steps=window_steps, streams_started=born[0])


def short_alone(engine, a, rng) -> float:
    """The median time to first token of three short prompts, each alone on ``engine``."""
    import numpy as np

    from paged_jax import SamplingParams

    times = []
    for i in range(3):
        prompt = rng.integers(3, engine.model_config.vocab_size, a.short_max).tolist()
        t0 = time.perf_counter()
        engine.add_request(f"alone{i}", None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), prompt)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def configs(a) -> list[dict]:
    rows = [dict(mode="budget", budget=b, multiple=None, policy="fcfs") for b in a.budgets]
    rows += [dict(mode="target", budget=None, multiple=k, policy=None) for k in a.multiples]
    if a.fcfs_multiple:
        rows.append(dict(mode="target", budget=None, multiple=a.fcfs_multiple, policy="fcfs"))
    return rows


def run(a) -> list[dict]:
    import numpy as np

    from paged_jax.engine import LLMEngine
    from paged_jax.engine_args import EngineArgs
    from paged_jax.models.tiny import make_tiny_model

    rows, decode_ms = [], a.decode_ms
    with tempfile.TemporaryDirectory() as tmp:
        max_len = max(a.long) + 128
        model = str(make_tiny_model(tmp, n_positions=max_len, **a.model))
        for cfg in configs(a):
            target = None if cfg["multiple"] is None else round(cfg["multiple"] * decode_ms, 2)
            engine = LLMEngine(EngineArgs(model=model, max_model_len=max_len, max_num_batched_tokens=cfg["budget"],
                                          max_num_seqs=a.max_num_seqs, target_itl_ms=target,
                                          scheduling_policy=cfg["policy"]))
            t0 = time.perf_counter()
            if a.warm_up:
                engine.warm_up(progress=False)
            else:
                from paged_jax.step_cost import calibrate

                calibrate(engine)
            print(f"engine {cfg}: warmed up in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            rng = np.random.default_rng(0)
            for rep in range(a.runs):
                before = engine.runner.num_compilations
                r = scenario(engine, a, rng, f"r{rep}")
            r.update(cfg, target_ms=target, budget=engine.scheduler_config.max_num_batched_tokens,
                     policy=type(engine.scheduler.policy).__name__, compiled=engine.runner.num_compilations - before)
            if decode_ms is None:
                decode_ms = 1e3 * r["decode_step_s"]
            r["short_alone_s"] = short_alone(engine, a, rng)
            cost = engine.get_stats()["step_cost"]
            if cost:
                r.update(prediction_error=cost["median_relative_error"],
                         median_chunk=(cost["prefill_chunk_tokens"] or {}).get("median"))
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            del engine
    return rows


def reference(rows: list[dict]) -> dict:
    """The engine's default: the fixed budget of 256 tokens (else the first row)."""
    return next((r for r in rows if r["mode"] == "budget" and r["budget"] == 256), rows[0])


def report(rows: list[dict], a) -> str:
    d = 1e3 * rows[0]["decode_step_s"]
    longest = max(a.long)
    alone = reference(rows)["short_alone_s"]
    streams = (f"{a.streams} streams decoding (each replaced by a fresh one after {a.stream_tokens} tokens)"
               if getattr(a, "stream_tokens", None) else f"{a.streams} streams decoding")
    lines = [f"{streams}; prompts of {', '.join(f'{n:,}' for n in a.long)} tokens arrive, then a "
             f"short prompt (32-{a.short_max} tokens) right behind them and every {a.short_every:g} s until the last one's "
             f"first token. "
             f"Decode step alone (the first row, before the long prompts): {d:.1f} ms; a {a.short_max}-token prompt alone (budget {reference(rows)['budget']}): "
             f"{alone:.2f} s.", "",
             "| mode | policy | target (ms) | gap p50 / p99 / max (ms) | p99 / target | max / target | "
             + " | ".join(f"TTFT {n:,} (s)" for n in a.long)
             + " | short TTFT p50 / p99 (s) | short p99 / alone | shorts served in the window | tokens/s | steps "
             "| prediction error | decode step start / end (ms) | compiles |",
             "|---|---|---:|---:|---:|---:|" + "---:|" * len(a.long) + "---:|" * 8]
    for r in rows:
        mode = f"budget {r['budget']}" if r["mode"] == "budget" else f"target {r['multiple']:g}x decode step"
        t = r["target_ms"]
        over = ("-", "-") if t is None else (f"{1e3 * r['gaps_s'][1] / t:.2f}", f"{1e3 * r['max_gap_s'] / t:.2f}")
        short = r["short_ttft_s"]
        err = f"{100 * r['prediction_error']:.0f} %" if r.get("prediction_error") is not None else "-"
        end = f"{1e3 * r['decode_step_end_s']:.1f}" if r.get("decode_step_end_s") is not None else "-"
        lines.append(
            f"| {mode} | {r['policy']} | {'-' if t is None else f'{t:.1f}'} | {1e3 * r['gaps_s'][0]:.1f} / "
            f"{1e3 * r['gaps_s'][1]:.1f} / {1e3 * r['max_gap_s']:.1f} | {over[0]} | {over[1]} | "
            + " | ".join(f"{r['long_ttft_s'][n]:.2f}" for n in a.long)
            + (f" | {short[0]:.2f} / {short[1]:.2f} | {short[1] / alone:.1f}x" if short else " | - | -")
            + f" | {r.get('num_shorts_in_window', r.get('num_shorts_served'))}/{r['num_shorts']} | {r['tokens_per_s']:,.0f} | {r['steps']} | {err} "
            f"| {1e3 * r['decode_step_s']:.1f} / {end} | {r['compiled']} |")
    lines.append(f"\nFigure: {a.figure} (time to first token of the {longest:,}-token prompt against the streams' "
                 "p99 gap).")
    return "\n".join(lines)


def figure(rows: list[dict], a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max(a.long)
    d = 1e3 * rows[0]["decode_step_s"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    fixed = sorted((r for r in rows if r["mode"] == "budget"), key=lambda r: r["budget"])
    ax.plot([1e3 * r["gaps_s"][1] for r in fixed], [r["long_ttft_s"][longest] for r in fixed], "o-", color="tab:gray",
            label="fixed token budget (FCFS)")
    for r in fixed:
        ax.annotate(str(r["budget"]), (1e3 * r["gaps_s"][1], r["long_ttft_s"][longest]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8, color="tab:gray")
    for r in (r for r in rows if r["mode"] == "target"):
        color = "tab:blue" if r["policy"] == "ShortFirst" else "tab:orange"
        ax.plot(1e3 * r["gaps_s"][1], r["long_ttft_s"][longest], "*", ms=12, color=color)
        ax.axvline(r["target_ms"], color=color, lw=0.6, ls=":")
        ax.annotate(f"target {r['multiple']:g}x" + ("" if r["policy"] == "ShortFirst" else " (FCFS)"),
                    (1e3 * r["gaps_s"][1], r["long_ttft_s"][longest]), textcoords="offset points", xytext=(4, -12),
                    fontsize=8, color=color)
    ax.plot([], [], "*", ms=12, color="tab:blue", label="latency target (short-first); dotted: the target")
    ax.set_xscale("log")
    ax.set_xlabel(f"streams' p99 inter-token gap (ms; decode step alone {d:.0f} ms)")
    ax.set_ylabel(f"{longest:,}-token prompt's time to first token (s)")
    ax.set_title(f"{a.streams} streams while {' + '.join(f'{n:,}' for n in a.long)}-token prompts prefill (CPU)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(a.figure).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.figure, dpi=120)
    Path(a.figure).with_suffix(".json").write_text(json.dumps(rows, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, nargs="+", default=[4000, 16000], help="the long prompts' tokens")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=128,
                    help="tokens each stream generates before a fresh one (a new 32-token prompt) replaces it "
                         "(0: the streams decode to the end, their contexts growing)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engines' (fewer step shapes to compile)")
    ap.add_argument("--budgets", type=int, nargs="*", default=[64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--multiples", type=float, nargs="*", default=[2, 5, 25],
                    help="targets as multiples of the measured decode step")
    ap.add_argument("--decode-ms", type=float, default=None,
                    help="the decode step the targets are multiples of (default: measured in the first run)")
    ap.add_argument("--rows", nargs="*", default=None, metavar="JSONL",
                    help="report and draw the rows printed (one JSON a line) by earlier runs, running nothing")
    ap.add_argument("--fcfs-multiple", type=float, default=5, help="also this target with FCFS (0: not)")
    ap.add_argument("--before-steps", type=int, default=20)
    ap.add_argument("--short-every", type=float, default=0.5, help="seconds between short prompts (0: none)")
    ap.add_argument("--short-max", type=int, default=256, help="the short prompts' longest")
    ap.add_argument("--runs", type=int, default=1, help="scenarios per engine (the last reported)")
    ap.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                    help="skip compiling every step shape first (the target's cost model is still calibrated)")
    ap.add_argument("--figure", default=str(FIGURE))
    ap.add_argument("--quick", action="store_true", help="a tiny model and short prompts: a smoke test")
    a = ap.parse_args(argv)
    a.model = STUTTER_MODEL
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    if a.rows is not None:
        rows = [json.loads(line) for path in a.rows for line in open(path) if line.startswith('{"')]
        for r in rows:
            r["long_ttft_s"] = {int(n): t for n, t in r["long_ttft_s"].items()}
    else:
        rows = run(a)
    figure(rows, a)
    print(report(rows, a))
    return rows


if __name__ == "__main__":
    main()
