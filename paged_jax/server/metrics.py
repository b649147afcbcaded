"""Prometheus metrics for the server (``GET /metrics``), with the ``prometheus_client`` library.

Two sources: a snapshot of ``LLMEngine.get_stats()`` (queues, KV blocks,
preemptions, generated tokens), read at scrape time by a custom collector, and
per-request latencies observed by the engine thread as outputs come out
(time to first token, inter-token latency, end-to-end latency).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "paged_jax_"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class _EngineStatsCollector:
    """Gauges and counters straight from the latest engine stats snapshot."""

    def __init__(self, get_stats: Callable[[], dict]):
        self._get_stats = get_stats

    def collect(self):
        s = self._get_stats()
        gauges = [
            ("engine_healthy", "1 while the engine thread serves requests; 0 once it has stopped (after a "
             "failed device step the other values are frozen at that moment).", s.get("engine_healthy", 1)),
            ("num_requests_running", "Requests in the running queue.", s["num_running"]),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"]),
            ("num_requests_swapped", "Requests swapped out to host memory.", s["num_swapped"]),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s["kv_cache_usage"]),
            ("num_free_gpu_blocks", "Free KV cache blocks on the device.", s["num_free_blocks"]),
            ("num_total_gpu_blocks", "KV cache blocks on the device (null block excluded).", s["num_total_blocks"]),
            ("num_free_cpu_blocks", "Free swap blocks in host memory.", s["num_free_cpu_blocks"]),
            ("num_total_cpu_blocks", "Swap blocks in host memory.", s["num_total_cpu_blocks"]),
            ("num_compilations", "Jitted step compilations so far.", s["num_compilations"]),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        pre = CounterMetricFamily(PREFIX + "num_preemptions", "Preempted requests, by preemption mode.",
                                  labels=["mode"])
        for mode, count in sorted(s["num_preemptions"].items()):
            pre.add_metric([mode], count)
        yield pre
        yield CounterMetricFamily(PREFIX + "generation_tokens", "Generated tokens.", value=s["num_generated_tokens"])
        yield CounterMetricFamily(PREFIX + "engine_steps", "Engine iterations.", value=s["num_steps"])
        yield from _step_cost_metrics(s)
        yield from _spec_decode_metrics(s)
        ms = s.get("multi_step")
        if ms:  # num_scheduler_steps > 1
            yield CounterMetricFamily(PREFIX + "multi_step_engine_steps", "Engine steps that ran several decode "
                                      "steps in one call (num_scheduler_steps).", value=ms["num_multi_steps"])
            yield CounterMetricFamily(PREFIX + "multi_step_tokens", "Tokens those steps decoded, before stops "
                                      "dropped any.", value=ms["num_multi_step_tokens"])


def _spec_decode_metrics(s: dict):
    """With speculative_config: vLLM's speculative decoding counters (``vllm:spec_decode_*``, here under
    this server's prefix), from which a dashboard computes the acceptance rate (accepted / draft tokens),
    the mean acceptance length (1 + accepted / drafts) and the acceptance per draft position."""
    sd = s.get("spec_decode")
    if not sd:
        return
    for name, doc in (("num_drafts", "Rows verified with at least one draft token."),
                      ("num_draft_tokens", "Draft tokens proposed and verified."),
                      ("num_accepted_tokens", "Draft tokens accepted.")):
        yield CounterMetricFamily(PREFIX + "spec_decode_" + name, doc, value=sd[name])
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each draft position (0 = the first draft).",
                                  labels=["position"])
    for pos, count in enumerate(sd["num_accepted_tokens_per_pos"]):
        per_pos.add_metric([str(pos)], count)
    yield per_pos


def _step_cost_metrics(s: dict):
    """With a latency target (target_itl_ms): the target, the step-cost model's coefficients, its median
    relative prediction error and the prefill chunk sizes it chose (see paged_jax.step_cost)."""
    cost = s.get("step_cost")
    if not cost:
        return
    yield GaugeMetricFamily(PREFIX + "target_itl_seconds", "The latency target the scheduler keeps.",
                            value=s["target_itl_ms"] / 1e3)
    coef = GaugeMetricFamily(PREFIX + "step_cost_coefficient", "The step-cost model's seconds per unit of each "
                             "term (step, row, token, token_past_knee, decode_context, prefill_pair, prefill_read).",
                             labels=["term"])
    for term, value in (cost["coefficients"] or {}).items():
        coef.add_metric([term], value)
    yield coef
    yield GaugeMetricFamily(PREFIX + "step_cost_knee_tokens", "Padded tokens where the model's token term bends.",
                            value=cost["knee_tokens"])
    if cost["median_relative_error"] is not None:
        yield GaugeMetricFamily(PREFIX + "step_cost_prediction_error", "Median |predicted - measured| / measured "
                                "step time over recent steps.", value=cost["median_relative_error"])
    chunks = GaugeMetricFamily(PREFIX + "prefill_chunk_tokens", "Prefill chunk sizes chosen over recent steps.",
                               labels=["stat"])
    for stat, value in (cost["prefill_chunk_tokens"] or {}).items():
        chunks.add_metric([stat], value)
    yield chunks


class ServerMetrics:
    """One registry per server (no global state, so tests can build several)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.stats_source: Callable[[], dict] = lambda: {}
        self.registry.register(_EngineStatsCollector(lambda: self.stats_source()))
        kw = dict(registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, **kw)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between successive outputs of a "
                             "request, per token.", buckets=_ITL_BUCKETS, **kw)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_E2E_BUCKETS, **kw)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", **kw)
        self.finished = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                ["finished_reason"], **kw)
        self.aborted = Counter(PREFIX + "request_aborted", "Requests aborted before they finished "
                               "(client disconnected).", **kw)

    # Called by AsyncLLMEngine (engine thread for on_output).
    def on_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def on_abort(self) -> None:
        self.aborted.inc()

    def on_output(self, stream, out, now: float) -> None:
        num = sum(len(c.token_ids) for c in out.outputs[:1])
        new = num - stream.num_tokens
        if new > 0:
            if stream.first_token_time is None:
                self.ttft.observe(now - stream.arrival_time)
                stream.first_token_time = now
            else:
                gap = (now - stream.last_token_time) / new
                for _ in range(new):
                    self.itl.observe(gap)
            stream.last_token_time = now
            stream.num_tokens = num
        if out.finished:
            self.e2e.observe(now - stream.arrival_time)
            if out.finish_message and num == 0:
                reason = "rejected"  # the engine could not run it (e.g. best_of > max_num_seqs)
            else:
                reason = out.outputs[0].finish_reason if out.outputs else None
            self.finished.labels(reason or "unknown").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
