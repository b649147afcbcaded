"""Simulation points as plain dicts, run in parallel processes, and the figure helpers they share."""

from __future__ import annotations

import csv
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

SPEC_DEFAULTS = dict(setup="opt-13b", system="vllm", workload="sharegpt", rate=1.0, num_requests=200, seed=0,
                     n=1, beam_width=0, mode="trace", block_size=16, preemption_mode=None, sample=None,
                     warmup_frac=0.1)


def make_requests(spec: dict):
    from experiments import workloads as w

    wl, rate, num, seed = spec["workload"], spec["rate"], spec["num_requests"], spec["seed"]
    if wl in w.DATASETS:
        return w.make_trace(wl, rate, num, seed, n=spec["n"], beam_width=spec["beam_width"])
    if wl.startswith("prefix-"):
        return w.make_prefix_trace(wl[len("prefix-"):], rate, num, seed)
    if wl == "chat":
        return w.make_chat_trace(rate, num, seed)
    raise ValueError(f"unknown workload {wl!r}")


def run_point(spec: dict) -> dict:
    """Simulate one (setup, system, workload, rate) point; returns the spec plus its measurements."""
    from experiments.hardware import get_setup
    from experiments.simulate import memory_breakdown, run_trace, saturation_throughput, sharing_savings

    spec = {**SPEC_DEFAULTS, **spec}
    setup = get_setup(spec["setup"])
    reqs = make_requests(spec)
    kw = dict(block_size=spec["block_size"], preemption_mode=spec["preemption_mode"])
    sampler = {"memory": memory_breakdown, "sharing": sharing_savings, None: None}[spec["sample"]]
    if spec["mode"] == "saturation":
        cap, res = saturation_throughput(setup, spec["system"], reqs, **kw)
    else:
        warmup = reqs[0].arrival + spec["warmup_frac"] * (reqs[-1].arrival - reqs[0].arrival)
        res = run_trace(setup, spec["system"], reqs, spec["rate"], warmup=warmup, sample_every=10 if sampler else 0,
                        on_sample=sampler, **kw)
        cap = float("nan")
    out = dict(spec)
    # A burst has no measuring window (every request arrives at 0): its batch sizes are not reported.
    batched = res.avg_batched_requests if spec["mode"] == "trace" else float("nan")
    out.update(normalized_latency=res.normalized_latency, capacity=cap, avg_batched_requests=batched,
               throughput=res.throughput, num_steps=res.num_steps, sim_time=res.sim_time, wall_time=res.wall_time,
               preempt_recompute=res.num_preemptions["recompute"], preempt_swap=res.num_preemptions["swap"],
               swapped_blocks=res.swapped_blocks, num_ignored=res.num_ignored, **res.memory)
    return out


def run_points(specs: list[dict], jobs: int = 1, desc: str = "simulating") -> list[dict]:
    """Run every spec (in ``jobs`` processes), biggest first; results in the specs' order."""
    from tqdm.auto import tqdm

    order = sorted(range(len(specs)), key=lambda i: -_cost(specs[i]))
    results: list[Optional[dict]] = [None] * len(specs)
    with tqdm(total=len(specs), desc=desc, dynamic_ncols=True) as bar:
        if jobs <= 1:
            for i in order:
                results[i] = run_point(specs[i])
                bar.update(1)
        else:
            with ProcessPoolExecutor(jobs) as pool:
                futures = {pool.submit(run_point, specs[i]): i for i in order}
                from concurrent.futures import as_completed

                for f in as_completed(futures):
                    results[futures[f]] = f.result()
                    bar.update(1)
    return results  # type: ignore[return-value]


def _cost(spec: dict) -> float:
    s = {**SPEC_DEFAULTS, **spec}
    per = {"sharegpt": 500, "alpaca": 80, "chat": 1300}.get(s["workload"], 400)
    return s["num_requests"] * per * max(s["n"], s["beam_width"], 1) * (16 / s["block_size"]) ** 0.3


@dataclass
class Context:
    out_dir: str
    quick: bool = False
    jobs: int = 1
    headlines: list = field(default_factory=list)

    def path(self, name: str) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        return os.path.join(self.out_dir, name)

    def headline(self, figure: str, metric: str, paper, ours: float, band: Optional[tuple] = None,
                 why: str = "") -> None:
        """A number to compare with the paper's; ``band`` = (lo, hi) it should fall in."""
        self.headlines.append(dict(figure=figure, metric=metric, paper=paper, ours=ours, band=band, why=why))


def write_csv(path: str, rows: list[dict]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in keys})


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def capacity_grid(cap: float, quick: bool) -> list[float]:
    """Request rates around a system's capacity, for a latency-vs-rate curve."""
    fracs = (0.4, 0.9, 1.15) if quick else (0.3, 0.6, 0.85, 1.0, 1.15)
    return [round(cap * f, 4) for f in fracs]


def trace_len(workload: str, quick: bool, n: int = 1) -> int:
    """Requests per simulated trace (fewer for requests of ``n`` samples)."""
    if quick:
        num = {"alpaca": 200, "chat": 60}.get(workload, 100)
    else:
        num = {"alpaca": 1500, "chat": 300}.get(workload, 600)
    return max(50, num // n)


def ratio(a: float, b: float) -> float:
    return a / b if b and np.isfinite(b) and b > 0 else float("nan")
