"""Structured output's cost, side by side in one run: 32 concurrent requests on the default model,
unconstrained against json_object, a 10-field JSON schema, a regex and a choice.

For each kind, in rounds that alternate the order of the kinds: tokens/s over the whole batch,
the time per token of the steps that decode all 32 rows (the mask's cost per token, free of
how long each output is), and the share of outputs that finish and validate (``jsonschema``,
``re.fullmatch``, membership). Then the time to first token of one request alone with a schema
never seen (its compile included) and with the same schema again (cache warm).

    python experiments/bench_structured.py [--requests 32] [--max-tokens 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.weigh_grammar_libs import SCHEMA  # noqa: E402  (10 fields: strings, numbers, enum, array, object)

REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}, [0-9]{4}"
CHOICE = ["positive", "negative", "neutral", "mixed", "unknown"]


def constraints():
    from paged_jax import StructuredOutputsParams as S

    return {"unconstrained": None, "json_object": S(json_object=True), "schema (10 fields)": S(json=SCHEMA),
            "regex": S(regex=REGEX), "choice": S(choice=CHOICE)}


def valid(kind: str, text: str) -> bool:
    import jsonschema

    try:
        if kind == "json_object":
            return isinstance(json.loads(text), dict)
        if kind.startswith("schema"):
            jsonschema.validate(json.loads(text), SCHEMA)
            return True
    except (ValueError, jsonschema.ValidationError):
        return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICE


def run_batch(engine, kind, constraint, n: int, max_tokens: int, tag: str):
    """n requests at once; (tokens, seconds, {decode step index: seconds} while all n rows decode, outputs)."""
    from paged_jax import SamplingParams

    for i in range(n):
        p = SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, structured_outputs=constraint)
        engine.add_request(f"{tag}-{i}", f"def handler_{i}(request):\n    result = ", p)
    outs, full_steps, k = {}, {}, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        decoding = (len(running) == n and not engine.scheduler.waiting
                    and all(seq.get_output_len() > 0 for g in running for seq in g.seqs))  # no prefill left
        s0 = time.perf_counter()
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        if decoding and len(outs) == 0:
            full_steps[k] = time.perf_counter() - s0
            k += 1
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
    return tokens, elapsed, full_steps, list(outs.values())


def ttft(engine, constraint, tag: str) -> float:
    from paged_jax import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(tag, "def main():\n    data = ", SamplingParams(temperature=0, max_tokens=1,
                                                                       structured_outputs=constraint))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    from paged_jax import LLM, StructuredOutputsParams

    llm = LLM(num_kv_blocks=1024, max_model_len=512, max_num_seqs=args.requests)
    engine = llm.llm_engine
    kinds = constraints()
    for kind, c in kinds.items():  # a round untimed: every step shape and both sampler variants compiled
        run_batch(engine, kind, c, args.requests, args.max_tokens, f"warm-{kind}")
    stats = {k: {"tokens": 0, "seconds": 0.0, "steps": {}, "valid": 0, "stopped": 0, "n": 0} for k in kinds}
    for r in range(args.rounds):
        order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
        for kind in order:
            tokens, secs, steps, outs = run_batch(engine, kind, kinds[kind], args.requests, args.max_tokens,
                                                  f"r{r}-{kind}")
            s = stats[kind]
            s["tokens"] += tokens
            s["seconds"] += secs
            for i, t in steps.items():
                s["steps"].setdefault(i, []).append(t)
            s["n"] += len(outs)
            if kinds[kind] is not None:
                s["stopped"] += sum(o.outputs[0].finish_reason == "stop" for o in outs)
                s["valid"] += sum(o.outputs[0].finish_reason == "stop" and valid(kind, o.outputs[0].text)
                                  for o in outs)

    base = stats["unconstrained"]
    base_tps = base["tokens"] / base["seconds"]
    print(f"{args.requests} concurrent requests, max_tokens={args.max_tokens}, {args.rounds} rounds, sampled "
          "(temperature 0.8), default model")
    print("| kind | tokens/s | ratio | decode steps with all rows running: ms per token | ratio (same steps) | "
          "finished (stop) | finished and valid |")
    print("|---|---|---|---|---|---|---|")
    for kind, s in stats.items():
        tps = s["tokens"] / s["seconds"]
        # The same decode steps (by index, so at the same context lengths) of both runs, medians over rounds.
        common = sorted(set(s["steps"]) & set(base["steps"]))
        if common:
            mine = sum(statistics.median(s["steps"][i]) for i in common)
            theirs = sum(statistics.median(base["steps"][i]) for i in common)
            per_tok = f"{mine / len(common) / args.requests * 1e3:.3f} ({len(common)} steps)"
            ratio = f"{theirs / mine:.2f}x"
        else:
            per_tok, ratio = "- (outputs end before)", "-"
        done = "-" if kinds[kind] is None else f"{s['stopped']}/{s['n']}"
        ok = "-" if kinds[kind] is None else f"{s['valid']}/{s['stopped']} ({100 * s['valid'] / max(1, s['stopped']):.0f} %)"
        print(f"| {kind} | {tps:.0f} | {tps / base_tps:.2f}x | {per_tok} | {ratio} | {done} | {ok} |", flush=True)

    # Time to first token, one request alone (medians of 5): a schema never compiled, the same schema again.
    for c in (None, kinds["schema (10 fields)"]):  # a batch of one compiled, both sampler variants
        ttft(engine, c, f"ttft-warm-up-{c is None}")
    free, cold, warm = [], [], []
    for i in range(5):
        fresh = StructuredOutputsParams(json={**SCHEMA, "title": f"fresh-{i}-{time.time_ns()}"})
        free.append(ttft(engine, None, f"ttft-free-{i}"))
        cold.append(ttft(engine, fresh, f"ttft-cold-{i}"))
        warm.append(ttft(engine, fresh, f"ttft-warm-{i}"))
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms"  # noqa: E731
    print(f"\ntime to first token, one request (median of 5): unconstrained {ms(free)}, a new 10-field schema "
          f"{ms(cold)} (its compile included), the same schema again {ms(warm)}")

if __name__ == "__main__":
    main()
