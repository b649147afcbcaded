"""What is left of one step's limits, and how many tokens of a row fit in them.

Every step has a token budget (``max_num_batched_tokens``) and a sequence budget
(``max_num_seqs``). With a latency target (``target_itl_ms``) it also has a time
budget: the scheduler serves decodes first, then fills prefill chunks up to the
largest amount whose predicted step time (:class:`paged_jax.step_cost.StepCostModel`)
stays within the target. The target never holds back a decode (a stream's next token
runs whatever the prediction), and never stops a prompt: the first prefill row of a
step gets at least one chunk up to its next block boundary even when the prediction
leaves no room (a target below any useful chunk still finishes every prompt, one
block per step). Chunks the target cuts end on block boundaries, so each step fills
whole blocks (what prefix caching registers) and wastes no partial block's work.
The prediction is a central estimate, so the time budget is the target divided by the
cost model's margin (:meth:`paged_jax.step_cost.StepCostModel.margin`: how much longer
than predicted the recent steps with prefill ran, at their 90th percentile), so that
most steps, not half of them, end within the target.

Until the model is calibrated (it needs measured steps of both kinds), steps hold at
most :data:`UNCALIBRATED_BUDGET` tokens: the engine's default chunked budget.

Plain Python, like the scheduler.
"""

from __future__ import annotations

from typing import Optional

from paged_jax.step_cost import StepCostModel, StepLoad

UNCALIBRATED_BUDGET = 256  # tokens per step before the cost model has seen enough steps


def check_target_itl_ms(target, chunked: bool = True) -> None:
    """ValueError naming a ``target_itl_ms`` that is not None or a positive number of milliseconds."""
    if target is None:
        return
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < float("inf"):
        raise ValueError(f"target_itl_ms must be None or a positive number of milliseconds, got {target!r}")
    if not chunked:
        raise ValueError(f"target_itl_ms={target!r} needs enable_chunked_prefill=True: the target sizes "
                         "prefill chunks, and without chunking a prompt runs whole")


class StepBudget:
    """One step's remaining limits: ``tokens`` and ``seqs`` left, and with ``target_s`` (seconds)
    and ``cost`` the time the rows taken so far (``load``) are predicted to need."""

    def __init__(self, tokens: int, seqs: int, block_size: int, target_s: Optional[float] = None,
                 cost: Optional[StepCostModel] = None):
        self.seqs = seqs
        self.block_size = block_size
        self.target_s = target_s if cost is not None else None
        self.cost = cost
        if self.target_s is not None and not cost.calibrated:
            tokens = min(tokens, UNCALIBRATED_BUDGET)
        elif self.target_s is not None:
            self.target_s /= cost.margin()  # room for the steps that run longer than predicted
        self.tokens = tokens
        self.load = StepLoad()

    @property
    def timed(self) -> bool:
        """Whether the target sizes this step's chunks (a target is set and the model is calibrated)."""
        return self.target_s is not None and self.cost.calibrated

    def take(self, need: int, start: int, chunked: bool) -> int:
        """Tokens of a row with ``need`` uncomputed tokens from position ``start`` that run this
        step (0: none fit), counted as taken. Without chunked prefill the row runs whole or not."""
        if not chunked:
            n = need if need <= self.tokens else 0
        elif need == 1 or not self.timed:
            n = min(need, self.tokens)
        else:
            n = self._timed_chunk(need, start)
        if n > 0:
            self.tokens -= n
            self.load.add(n, start)
        return n

    def prompt_may_start(self) -> bool:
        """Whether a waiting prompt gets any tokens this step (chunked prefill)."""
        if self.tokens <= 0:
            return False
        return not self.timed or not self.load.prefill_chunks or self._fits(1, 0)

    def _timed_chunk(self, need: int, start: int) -> int:
        limit = min(need, self.tokens)
        if limit <= 0:
            return 0
        # The largest n within the target: predictions grow with n (non-negative coefficients).
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(mid, start):
                lo = mid
            else:
                hi = mid - 1
        n = lo
        if n < need:  # cut by the target or the token budget: end the chunk on a block boundary
            n = max(0, (start + n) // self.block_size * self.block_size - start)
        if n == 0 and not self.load.prefill_chunks:
            # Progress guaranteed: the step's first prefill row gets up to its next block boundary.
            n = min(limit, self.block_size - start % self.block_size)
        return n

    def _fits(self, n: int, start: int) -> bool:
        return self.cost.predict(self.load.plus(n, start)) <= self.target_s
