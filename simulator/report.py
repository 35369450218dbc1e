"""The simulator's report, in the load generator's schema (``ksana bench serve``), so one tool compares them.

Per request and in aggregate: TTFT, TPOT, ITL and E2EL as vLLM defines them, throughput and goodput under SLOs;
the simulator adds what only it sees: each request's queueing time (arrival to first scheduled) and preemptions.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from ksana.bench.serve import BenchRequest, RequestResult, summarize
from ksana.simulator.replay import RequestTimeline

SLO_METRICS = ("ttft", "tpot", "e2el")


def request_result(timeline: RequestTimeline) -> RequestResult:
    times = timeline.token_times_s
    result = RequestResult(prompt_len=timeline.prompt_len, output_len=len(times), send_time=timeline.arrival_s)
    if times and timeline.error is None:
        result.ttft = times[0] - timeline.arrival_s
        result.itl = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        result.e2el = (timeline.finished_s or times[-1]) - timeline.arrival_s
        result.success = True
    else:
        result.error = timeline.error or "no tokens"
    return result


def build_report(timelines: Sequence[RequestTimeline], *, model: str, request_rate: float, burstiness: float,
                 dataset: str, seed: int, goodput: dict[str, float] | None,
                 percentiles: Sequence[float] = (50.0, 90.0, 99.0)) -> dict[str, Any]:
    """The load generator's summary of the simulated requests, plus queueing and preemption figures."""
    results = [request_result(t) for t in timelines]
    duration = max((t.finished_s or 0.0) for t in timelines) if timelines else 0.0
    args = argparse.Namespace(base_url="simulated", endpoint="/v1/completions", request_rate=request_rate,
                              burstiness=burstiness, max_concurrency=None, dataset=dataset, seed=seed,
                              goodput=list((goodput or {}).items()), metric_percentiles=list(percentiles))
    requests = [BenchRequest([], t.prompt_len, len(t.token_times_s), t.arrival_s) for t in timelines]
    summary = summarize(args, requests, results, max(duration, 1e-9), model)
    queueing_ms = [((t.first_scheduled_s or t.arrival_s) - t.arrival_s) * 1000 for t in timelines]
    summary["mean_queueing_ms"] = statistics.fmean(queueing_ms) if queueing_ms else 0.0
    summary["median_queueing_ms"] = statistics.median(queueing_ms) if queueing_ms else 0.0
    summary["total_preemptions"] = sum(t.num_preemptions for t in timelines)
    summary["num_preempted_requests"] = sum(1 for t in timelines if t.num_preemptions)
    summary["total_cached_tokens"] = sum(t.num_cached_tokens for t in timelines)
    for row, timeline, queueing in zip(summary["requests"], timelines, queueing_ms, strict=True):
        row["queueing_time"] = queueing / 1000
        row["num_preemptions"] = timeline.num_preemptions
        row["num_cached_tokens"] = timeline.num_cached_tokens
    return summary
