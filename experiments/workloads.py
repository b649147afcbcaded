"""Synthetic request traces with the paper's published statistics (Sec. 6.1, Fig. 11).

The ShareGPT and Alpaca datasets are not shipped (and the hub is out of reach),
so lengths are drawn from log-normal distributions whose means after truncation
match the published means: ShareGPT input 161.31 / output 337.99 tokens, Alpaca
19.31 / 58.45. Medians are not published; the spreads (log-space sigma) are
chosen to reproduce the paper's qualitative statement that ShareGPT has a much
higher variance than Alpaca. As in the paper, pairs with ``input + output >=
2048`` are redrawn. The location ``mu`` of each distribution is solved by
bisection so that the mean of the *truncated* distribution hits the target
(:func:`calibrate`; checked by ``tests/test_sim_workloads.py``).

Arrivals are a Poisson process at ``rate`` requests per second. Other
workloads: parallel sampling and beam search (``n`` / ``beam_width`` per
request), shared prefixes (a 1-shot 80-token or 5-shot 341-token prefix before
a WMT16-like sentence), and a chatbot (history of earlier turns cut to its last
1024 tokens, outputs up to 1024 tokens).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class LengthDist:
    """Log-normal input and output lengths with target means (after truncation)."""

    name: str
    mean_input: float
    mean_output: float
    sigma_input: float
    sigma_output: float


DATASETS = {
    "sharegpt": LengthDist("ShareGPT", 161.31, 337.99, 1.1, 0.9),
    "alpaca": LengthDist("Alpaca", 19.31, 58.45, 0.55, 0.8),
}


@dataclass
class Request:
    arrival: float  # seconds
    prompt_len: int  # prompt tokens, prefix included
    output_len: int  # tokens generated (fixed in advance: max_tokens, EOS ignored)
    n: int = 1  # parallel samples
    beam_width: int = 0  # > 0: beam search of this width
    prefix_len: int = 0  # leading prompt tokens shared by every request with a prefix


def _draw(rng: np.random.Generator, mu_in: float, mu_out: float, d: LengthDist, size: int,
          max_total: int = MAX_TOTAL_LEN) -> tuple[np.ndarray, np.ndarray]:
    """``size`` (input, output) pairs, redrawing any with input + output >= max_total."""
    ins = np.empty(0, np.int64)
    outs = np.empty(0, np.int64)
    while len(ins) < size:
        k = 2 * (size - len(ins)) + 16
        a = np.maximum(1, np.rint(rng.lognormal(mu_in, d.sigma_input, k))).astype(np.int64)
        b = np.maximum(1, np.rint(rng.lognormal(mu_out, d.sigma_output, k))).astype(np.int64)
        ok = a + b < max_total
        ins, outs = np.concatenate([ins, a[ok]]), np.concatenate([outs, b[ok]])
    return ins[:size], outs[:size]


@functools.lru_cache(maxsize=None)
def calibrate(name: str, samples: int = 200_000) -> tuple[float, float]:
    """(mu_input, mu_output) such that the means of the truncated distribution (pairs with
    input + output < 2048, which is what redrawing the others gives) match the dataset's.
    One fixed set of normal draws serves every evaluation (common random numbers)."""
    d = get_dataset(name)
    rng = np.random.default_rng(0)
    z_in, z_out = rng.standard_normal(samples), rng.standard_normal(samples)

    def means(mu_in: float, mu_out: float) -> tuple[float, float]:
        a = np.maximum(1, np.rint(np.exp(mu_in + d.sigma_input * z_in)))
        b = np.maximum(1, np.rint(np.exp(mu_out + d.sigma_output * z_out)))
        ok = a + b < MAX_TOTAL_LEN
        return a[ok].mean(), b[ok].mean()

    mu_in = np.log(d.mean_input) - d.sigma_input ** 2 / 2
    mu_out = np.log(d.mean_output) - d.sigma_output ** 2 / 2
    for _ in range(4):  # the two truncations interact: alternate a few times
        mu_in = _bisect(lambda m: means(m, mu_out)[0], d.mean_input, mu_in)
        mu_out = _bisect(lambda m: means(mu_in, m)[1], d.mean_output, mu_out)
    return float(mu_in), float(mu_out)


def _bisect(mean_of, target: float, guess: float) -> float:
    lo, hi = guess - 1.5, guess + 1.5
    for _ in range(30):
        mid = (lo + hi) / 2
        if mean_of(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def get_dataset(name: str) -> LengthDist:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}")
    return DATASETS[name]


def sample_lengths(name: str, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    mu_in, mu_out = calibrate(name)
    return _draw(np.random.default_rng(seed), mu_in, mu_out, get_dataset(name), size)


def poisson_arrivals(rate: float, size: int, seed: int = 0) -> np.ndarray:
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    return np.cumsum(np.random.default_rng(seed + 1).exponential(1.0 / rate, size))


def _check(num_requests: int) -> None:
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")


def make_trace(dataset: str, rate: float, num_requests: int, seed: int = 0, n: int = 1,
               beam_width: int = 0) -> list[Request]:
    """Requests with dataset lengths and Poisson arrivals; ``n`` samples or a beam of ``beam_width`` each."""
    _check(num_requests)
    if n < 1 or beam_width < 0 or (beam_width and n != 1):
        raise ValueError(f"n must be >= 1 and beam_width >= 0, not both > 1; got n={n!r}, beam_width={beam_width!r}")
    ins, outs = sample_lengths(dataset, num_requests, seed)
    arr = poisson_arrivals(rate, num_requests, seed)
    return [Request(float(t), int(i), int(o), n, beam_width) for t, i, o in zip(arr, ins, outs)]


# WMT16 En-De: source sentences of about 30 tokens, translations of about 35 (LLaMA tokenizer).
TRANSLATION = LengthDist("WMT16 En-De", 30.0, 35.0, 0.5, 0.5)
PREFIX_LENS = {"1-shot": 80, "5-shot": 341}


def make_prefix_trace(shots: str, rate: float, num_requests: int, seed: int = 0) -> list[Request]:
    """Translation requests whose prompts start with a shared few-shot prefix (Fig. 16)."""
    _check(num_requests)
    if shots not in PREFIX_LENS:
        raise ValueError(f"shots must be one of {sorted(PREFIX_LENS)}, got {shots!r}")
    rng = np.random.default_rng(seed)
    d = TRANSLATION
    ins = np.maximum(1, np.rint(rng.lognormal(np.log(d.mean_input) - d.sigma_input ** 2 / 2, d.sigma_input,
                                              num_requests))).astype(int)
    outs = np.maximum(1, np.rint(rng.lognormal(np.log(d.mean_output) - d.sigma_output ** 2 / 2, d.sigma_output,
                                               num_requests))).astype(int)
    plen = PREFIX_LENS[shots]
    arr = poisson_arrivals(rate, num_requests, seed)
    return [Request(float(t), plen + int(i), int(o), prefix_len=plen) for t, i, o in zip(arr, ins, outs)]


CHAT_HISTORY_LIMIT = 1024
CHAT_MAX_OUTPUT = 1024


def make_chat_trace(rate: float, num_requests: int, seed: int = 0, mean_turns: float = 2.0) -> list[Request]:
    """Chatbot (Fig. 17): the prompt is the conversation so far (earlier turns' inputs and
    outputs, a Poisson(``mean_turns``) number of them, and the new input, all with ShareGPT
    lengths) cut to its last 1024 tokens; the reply is a ShareGPT output capped at 1024."""
    _check(num_requests)
    rng = np.random.default_rng(seed + 2)
    turns = rng.poisson(mean_turns, num_requests)
    ins, outs = sample_lengths("sharegpt", int(turns.sum()) + 2 * num_requests, seed)
    arr = poisson_arrivals(rate, num_requests, seed)
    reqs, k = [], 0
    for r in range(num_requests):
        hist = int(ins[k:k + turns[r]].sum() + outs[k:k + turns[r]].sum())
        k += turns[r]
        prompt = min(CHAT_HISTORY_LIMIT, hist + int(ins[k]))
        reqs.append(Request(float(arr[r]), prompt, min(CHAT_MAX_OUTPUT, int(outs[k + 1]))))
        k += 2
    return reqs


def trace_summary(reqs: list[Request]) -> dict:
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    return {"num_requests": len(reqs), "mean_input": float(ins.mean()), "mean_output": float(outs.mean()),
            "duration_s": reqs[-1].arrival - reqs[0].arrival if reqs else 0.0}


def describe(name: Optional[str] = None) -> str:
    names = [name] if name else sorted(DATASETS)
    lines = []
    for n in names:
        d = get_dataset(n)
        mu_in, mu_out = calibrate(n)
        lines.append(f"{d.name}: input lognormal(mu={mu_in:.3f}, sigma={d.sigma_input}) mean {d.mean_input}, "
                     f"output lognormal(mu={mu_out:.3f}, sigma={d.sigma_output}) mean {d.mean_output}, "
                     f"input + output < {MAX_TOTAL_LEN}")
    return "\n".join(lines)
