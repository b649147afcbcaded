"""A model of one engine step's time, fitted online from measured steps.

The scheduler keeps a latency target (``target_itl_ms``) by predicting what a step
will cost before it runs it: running streams get their next token once per step,
so a step's time is the gap they see. A step's time is modelled as a weighted sum
of what it holds (:class:`StepLoad`)::

    seconds = c_step + c_row * rows
              + c_token * min(padded_tokens, knee) + c_token_past_knee * max(padded_tokens - knee, 0)
              + c_decode_context * cached tokens read by decode rows
              + c_prefill_pair * query-key pairs of prefill rows
              + c_prefill_read * cached tokens read by prefill rows, once per query tile

``padded_tokens`` is the token count the executor really computes (the real engine
pads a step to a power-of-two bucket, so a chunk that spills into the next bucket
costs that bucket); the pairs of a prefill chunk of ``q`` tokens after ``c`` cached
ones are ``q * (c + (q + 1) / 2)`` (causal); a chunk reads its ``c + q`` keys once per
query tile of the executor's attention kernel (``query_tile`` tokens; 256 on the CPU's ragged kernel),
so a small chunk late in a long prompt costs about what a full tile costs. These are the terms of the simulator's
roofline (``experiments/cost_model.py``) that grow with a step's contents. The
token term bends at a ``knee``: on a GPU it is the roofline's ridge (below it the
layers' time is reading the weights, whatever the tokens: ``c_token`` near 0; above
it their FLOPs); on a CPU a token costs more in a small step than in a large one
(``c_token > c_token_past_knee``). The coefficients and the knee (from :data:`KNEES`,
the best fit) are what is fitted, since they depend on the machine and the model.

The fit is a non-negative least squares on relative errors (a 5 ms decode step
counts as much as a 300 ms prefill), made robust (:func:`robust_nnls`: a least-median
start, then Tukey's biweight) so that a measurement far off the others (a page
fault, another process, a compilation the engine did not flag) does not move it. It keeps the last ``window`` decode-only
steps and, apart, steps with prefill tokens by size class (:func:`size_class`: their padded
tokens' power of two), the last ``window // 4`` of each class, so that a long run of decodes does
not forget what prefill costs, nor a long run of one-block chunks (late in a long prompt under a
tight target) what a large chunk costs: with every kept step of one size the token terms cannot
be told from the step term, and a fit that kept only those priced a 2,000-token chunk as free. Until :attr:`StepCostModel.calibrated`
(enough steps of both kinds), the scheduler does not use it.

Plain Python and numpy (scipy for the non-negative least squares): the real engine
and the simulator use this same class.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

TERMS = ("step", "row", "token", "token_past_knee", "decode_context", "prefill_pair", "prefill_read")
MARGIN_QUANTILE, MAX_MARGIN, MIN_MARGIN_STEPS = 0.9, 1.5, 8  # see StepCostModel.margin
MIN_CLASS_WINDOW = 8  # steps with prefill kept per size class at least (see the module's docstring)
KNEES = (1, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024)  # tried as the roofline's ridge


@dataclass
class StepLoad:
    """What one step holds, summed over its rows (``add(q, c)``: a row of ``q`` new tokens
    after ``c`` cached ones)."""

    rows: int = 0
    tokens: int = 0
    decode_context: int = 0  # cached tokens read by rows of one new token
    prefill_pairs: float = 0.0  # query-key pairs computed by rows of several new tokens
    prefill_chunks: list[int] = field(default_factory=list)  # new tokens of each prefill row
    prefill_rows: list[tuple[int, int]] = field(default_factory=list)  # (new, cached) tokens of each prefill row

    def add(self, q: int, c: int) -> None:
        self.rows += 1
        self.tokens += q
        if q > 1:
            self.prefill_pairs += q * (c + (q + 1) / 2)
            self.prefill_chunks.append(q)
            self.prefill_rows.append((q, c))
        else:
            self.decode_context += c

    def plus(self, q: int, c: int) -> "StepLoad":
        """A copy with one more row (the chunk sizes are not copied: predictions ignore them)."""
        load = StepLoad(self.rows, self.tokens, self.decode_context, self.prefill_pairs, [], list(self.prefill_rows))
        load.add(q, c)
        return load

    @classmethod
    def of(cls, rows: Iterable[tuple[int, int]]) -> "StepLoad":
        load = cls()
        for q, c in rows:
            load.add(q, c)
        return load


class StepCostModel:
    """Predicted step seconds from a :class:`StepLoad`; :meth:`observe` feeds measured steps.

    ``padded_tokens(tokens, rows)`` is the token count the executor computes (default:
    the tokens themselves); ``query_tile`` the query tile of its attention kernel (None: one per row). A fit runs every ``refit_every`` observations; at least
    ``min_observations`` decode-only steps and as many steps with prefill tokens are
    needed before the model is :attr:`calibrated`.
    """

    def __init__(self, padded_tokens: Optional[Callable[[int, int], int]] = None, window: int = 128,
                 refit_every: int = 16, min_observations: int = 4, query_tile: Optional[int] = None):
        import scipy.optimize  # noqa: F401  (imported now, not by the first fit in the middle of serving)

        self.padded_tokens = padded_tokens or (lambda tokens, rows: tokens)
        self.query_tile = query_tile  # None: a prefill row reads its keys once
        self.refit_every, self.min_observations = refit_every, min_observations
        self._decode: deque = deque(maxlen=window)  # (features, seconds) of decode-only steps
        self._class_window = max(MIN_CLASS_WINDOW, window // 4)
        self._mixed: dict[int, deque] = {}  # ... of steps with prefill tokens, by size_class
        self._since_fit = 0
        self.coefficients: Optional[np.ndarray] = None  # seconds per unit of each of TERMS
        self.knee = 1  # padded tokens where the token term bends (see the module's docstring)
        self.num_observations = 0
        self.num_rejected = 0  # measurements refused (not a positive finite number of seconds)
        self._errors: deque = deque(maxlen=window)  # |predicted - measured| / measured, before each fit saw it
        self._ratios: deque = deque(maxlen=window)  # measured / predicted of steps with prefill tokens, likewise
        self._chunks: deque = deque(maxlen=window)  # prefill chunk sizes of the observed steps

    # ---- prediction ------------------------------------------------------------
    def features(self, load: StepLoad) -> np.ndarray:
        """The amounts of step, row, padded tokens, decode context, prefill pairs, prefill reads (:func:`with_knee` splits
        the tokens at the knee into the two token terms)."""
        return np.array([1.0, load.rows, self.padded_tokens(load.tokens, load.rows) if load.rows else 0,
                         load.decode_context, load.prefill_pairs, self._prefill_read(load)], dtype=float)

    def _prefill_read(self, load: StepLoad) -> float:
        tile = self.query_tile
        return float(sum((c + q) * (-(-q // tile) if tile else 1) for q, c in load.prefill_rows))

    @property
    def calibrated(self) -> bool:
        return self.coefficients is not None

    def predict(self, load: StepLoad) -> float:
        """Predicted seconds of a step holding ``load``; ValueError before the model is calibrated."""
        if self.coefficients is None:
            raise ValueError("the step-cost model is not calibrated yet (too few measured steps)")
        return float(with_knee(self.features(load), self.knee) @ self.coefficients)

    # ---- fitting ---------------------------------------------------------------
    def observe(self, load: StepLoad, seconds: float) -> None:
        """Record a measured step. A measurement that is not a positive finite number is refused
        (counted in ``num_rejected``): it says nothing about the step."""
        if load.rows == 0:
            return
        if not (isinstance(seconds, (int, float)) and np.isfinite(seconds) and seconds > 0):
            self.num_rejected += 1
            return
        x = self.features(load)
        if self.coefficients is not None:
            predicted = float(with_knee(x, self.knee) @ self.coefficients)
            self._errors.append(abs(predicted - seconds) / seconds)
            if load.prefill_chunks and predicted > 0:
                self._ratios.append(seconds / predicted)
        if load.prefill_chunks:
            kept = self._mixed.setdefault(size_class(x[2]), deque(maxlen=self._class_window))
        else:
            kept = self._decode
        kept.append((x, float(seconds)))
        self._chunks.extend(load.prefill_chunks)
        self.num_observations += 1
        self._since_fit += 1
        # Refit every refit_every steps; more often while the model has seen few (each fit then is cheap).
        every = self.refit_every if self.num_observations >= 8 * self.refit_every else max(1, self.refit_every // 4)
        if self._since_fit >= every or (self.coefficients is None and self._enough()):
            self.fit()

    def _enough(self, least: Optional[int] = None) -> bool:
        """Whether at least ``least`` (default ``min_observations``) steps of each kind are kept."""
        mixed = sum(map(len, self._mixed.values()))
        return min(len(self._decode), mixed) >= (least or self.min_observations)

    def fit(self) -> None:
        """Refit the coefficients on the kept steps (nothing happens until there are enough)."""
        self._since_fit = 0
        if not self._enough():
            return
        obs = [*self._decode, *(o for kept in self._mixed.values() for o in kept)]
        x = np.array([o[0] for o in obs])
        y = np.array([o[1] for o in obs])
        b, w = robust_nnls(with_knee(x, self.knee), y)
        # The knee: the one whose fit, with the robust weights just found, leaves the least weighted error.
        def loss(knee):
            xk = with_knee(x, knee) / y[:, None]
            sw = np.sqrt(w)
            return nnls_fit(xk * sw[:, None], sw)[1]
        knee = min(KNEES, key=loss)
        if knee != self.knee:
            self.knee = knee
            b, _ = robust_nnls(with_knee(x, knee), y)
        self.coefficients = b

    def margin(self) -> float:
        """The factor by which a step with prefill tokens ran longer than predicted at the
        :data:`MARGIN_QUANTILE` of recent such steps (each predicted before it was measured), in
        [1, :data:`MAX_MARGIN`]; 1 until :data:`MIN_MARGIN_STEPS` are known. The step budget divides the
        target by it, so that most steps, not half, end within the target: the prediction is a
        central estimate and a step's time scatters around it. A quantile moves little for one wild
        measurement, and the cap keeps a run of them from shrinking every chunk to its minimum."""
        if len(self._ratios) < MIN_MARGIN_STEPS:
            return 1.0
        return float(min(MAX_MARGIN, max(1.0, np.quantile(self._ratios, MARGIN_QUANTILE))))

    # ---- reporting -------------------------------------------------------------
    def stats(self) -> dict:
        """Coefficients (seconds per unit of each term), the median relative prediction error of
        recent steps (each predicted before it was measured), and the prefill chunk sizes chosen."""
        chunks = list(self._chunks)
        return {
            "calibrated": self.calibrated,
            "coefficients": (None if self.coefficients is None
                             else {t: float(c) for t, c in zip(TERMS, self.coefficients)}),
            "knee_tokens": self.knee,
            "median_relative_error": float(np.median(self._errors)) if self._errors else None,
            "margin": self.margin(),
            "num_observations": self.num_observations,
            "num_rejected": self.num_rejected,
            "prefill_chunk_tokens": ({"last": chunks[-1], "median": float(np.median(chunks)), "max": max(chunks)}
                                     if chunks else None),
        }


def size_class(padded_tokens: float) -> int:
    """The class a step with prefill tokens is kept in: its padded tokens' power of two."""
    return int(max(padded_tokens, 1)).bit_length()


def with_knee(x: np.ndarray, knee: int) -> np.ndarray:
    """The terms of :data:`TERMS` from :meth:`StepCostModel.features`: the tokens (column 2) split
    into those up to ``knee`` and those past it."""
    x = np.asarray(x, dtype=float)
    t = x[..., 2:3]
    return np.concatenate([x[..., :2], np.minimum(t, knee), np.maximum(t - knee, 0), x[..., 3:]], axis=-1)


def nnls_fit(a: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares ``a @ b ~ target`` with ``a``'s columns scaled to unit norm while
    solving (terms of very different magnitudes, steps against pairs, solve evenly). Returns (b, residual norm)."""
    from scipy.optimize import nnls

    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    b, res = nnls(a / norms, target)
    return b / norms, float(res)


def robust_nnls(x: np.ndarray, y: np.ndarray, tuning: float = 4.685, iterations: int = 10,
                starts: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative ``b`` fitting ``x @ b`` to ``y`` in relative terms, robustly: Tukey's biweight of
    the relative residuals ``(x @ b - y) / y``, by iteratively reweighted non-negative least squares.
    Returns ``b`` and the rows' final weights (0: ignored as an outlier).

    A least-squares start would be dragged by wild rows (a step measured 30x too fast has a relative
    residual of 29), and reweighting may not recover from it: the start is the best, by median absolute
    residual, of fits to the whole data and to ``starts`` small random subsets (least median of squares,
    as in robust regression). The residuals' scale comes from their median absolute deviation, so a
    row many scales off gets weight zero."""
    a = x / y[:, None]  # relative residual of row i: a[i] @ b - 1
    ones = np.ones(len(y))
    rng = np.random.default_rng(0)  # deterministic: the same data give the same fit
    size = min(len(y), 2 * a.shape[1])
    candidates = [nnls_fit(a, ones)[0]] + [nnls_fit(a[rows], ones[rows])[0]
                                           for rows in (rng.choice(len(y), size, replace=False) for _ in range(starts))]
    b = min(candidates, key=lambda c: float(np.median(np.abs(a @ c - 1.0))))
    w = ones
    for _ in range(iterations):
        r = a @ b - 1.0
        scale = 1.4826 * float(np.median(np.abs(r)))
        if scale < 1e-12:
            break
        u = r / (tuning * scale)
        w = np.where(np.abs(u) < 1, (1 - u * u) ** 2, 0.0)
        sw = np.sqrt(w)
        b = nnls_fit(a * sw[:, None], sw)[0]
    return b, w


def calibrate(engine, max_rounds: int = 4) -> bool:
    """Calibrate ``engine``'s step-cost model before serving (``LLMEngine.warm_up`` calls it when a
    latency target is set) and return whether it is calibrated. Runs short internal requests on an
    idle engine, the target set aside meanwhile so that steps span the whole token budget: prompts
    from two blocks to the budget, one arriving per step beside the decodes of the earlier ones (mixed
    steps of every size), one of them past the budget (a chunk after a long context), then the decodes
    alone. Steps that compile are not counted: after warm-up's compilation one round is usually enough."""
    from paged_jax.sampling_params import SamplingParams

    cost = engine.scheduler.step_cost
    if cost is None or engine.has_unfinished_requests():
        return cost is not None and cost.calibrated
    c, bm = engine.scheduler_config, engine.block_manager
    room = bm.get_num_free_gpu_blocks() * bm.block_size // 2  # use at most half the KV cache
    top = max(2, min(c.max_num_batched_tokens, c.max_model_len - 17))
    sizes = sorted({int(x) for x in np.geomspace(2 * bm.block_size, top, 8) if x >= 2})[:c.max_num_seqs]
    sizes.append(min(2 * c.max_num_batched_tokens, c.max_model_len - 17))
    while len(sizes) > 1 and sum(sizes) + 16 * len(sizes) > room:
        sizes.pop()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    target, c.target_itl_ms = c.target_itl_ms, None
    try:
        for r in range(max_rounds):
            for i, size in enumerate(sizes):
                # Token ids distinct per round and request, so that prefix caching does not skip the work.
                engine.add_request(f"__calibrate_{r}_{i}", None, params,
                                   [(r * 7919 + i * 104729 + j) % engine.vocab_size for j in range(max(2, size))])
                engine.step()
            while engine.has_unfinished_requests():
                engine.step()
            if cost._enough(2 * cost.min_observations):
                break
    finally:
        c.target_itl_ms = target
    cost.fit()
    return cost.calibrated
