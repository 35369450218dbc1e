"""Prometheus metrics under KsanaLLM's names, in a registry private to one server.

Request metrics are observed by the I/O actor as deltas arrive (it sees every token of every request); the
scheduler gauges come with each ``TokensOut``; the cache gauges are read from the cache manager through a
``GetCacheStats`` request at scrape time, so ``/metrics`` shows the block counts as they are now (the tests use them
to see an aborted request's blocks come back). Counters carry Prometheus' ``_total`` sample suffix
(``forward_req_total_num_total``); the metric family keeps KsanaLLM's name.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.exposition import generate_latest

from ksana.disagg.kv_connector import KVConnector
from ksana.messages import CacheStats
from ksana.spec.stats import SpecDecodingStats

disable_created_metrics()  # the *_created series only double the scrape size

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_US_BUCKETS = (500, 1e3, 2.5e3, 5e3, 1e4, 2.5e4, 5e4, 1e5, 2.5e5, 5e5, 1e6, 2.5e6, 5e6, 1e7, 3e7, 6e7, 3e8)
_LEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.time_to_first_token_us = Histogram(
            "time_to_first_token_us", "Arrival to first output token, microseconds", buckets=_US_BUCKETS, registry=r)
        self.inter_token_interval_latency_us = Histogram(
            "inter_token_interval_latency_us", "Gap between consecutive output tokens of a request, microseconds",
            buckets=_US_BUCKETS, registry=r)
        self.total_latency_us = Histogram(
            "total_latency_us", "Arrival to finish of a request, microseconds", buckets=_US_BUCKETS, registry=r)
        self.input_token_len = Histogram(
            "input_token_len", "Prompt tokens per request", buckets=_LEN_BUCKETS, registry=r)
        self.output_token_len = Histogram(
            "output_token_len", "Output tokens per finished request", buckets=_LEN_BUCKETS, registry=r)
        self.forward_req_total_num = Counter(
            "forward_req_total_num", "Requests sent to the engine (each parallel sample and beam step counts)",
            registry=r)
        self.forward_req_aborted_num = Counter(
            "forward_req_aborted_num", "Requests aborted (client gone, shutdown)", registry=r)
        self.forward_req_error_num = Counter(
            "forward_req_error_num", "Requests rejected or failed (queue full, timeout, bad prompt)", registry=r)
        self.forward_req_timeout_num = Counter(
            "forward_req_timeout_num", "Requests rejected after waiting_timeout_in_ms", registry=r)
        self.prefix_cache_hit_req_num = Counter(
            "prefix_cache_hit_req_num", "Requests whose prompt hit the prefix cache", registry=r)
        self.prefix_cache_hit_token_num = Counter(
            "prefix_cache_hit_token_num", "Prompt tokens served from the prefix cache", registry=r)
        # The cache manager's own running totals, read at scrape time like the block gauges.
        self.prefix_cache_hit_block_num = Gauge(
            "prefix_cache_hit_block_num", "KV blocks served from the prefix cache so far", registry=r)
        self.full_prompt_matched_req_num = Gauge(
            "full_prompt_matched_req_num", "Requests whose whole prompt was cached so far", registry=r)
        self.batch_scheduler_batch_size = Gauge(
            "batch_scheduler_batch_size", "Running requests after the latest step", registry=r)
        self.batch_scheduler_waiting_size = Gauge(
            "batch_scheduler_waiting_size", "Waiting requests after the latest step", registry=r)
        self.block_manager_total_block_num = Gauge(
            "block_manager_total_block_num", "KV cache blocks in the pool", registry=r)
        self.block_manager_free_block_num = Gauge(
            "block_manager_free_block_num", "Free KV cache blocks", registry=r)
        self.block_manager_used_block_num = Gauge(
            "block_manager_used_block_num", "KV cache blocks held by requests", registry=r)
        self.block_manager_request_num = Gauge(
            "block_manager_request_num", "Requests holding KV cache blocks", registry=r)

        # Speculative decoding (KsanaLLM's two counters), and the rates they give, by draft position too.
        self.spec = SpecDecodingStats()
        self.spec_draft_token_num = Counter(
            "spec_draft_token_num", "Draft tokens verified by the model", registry=r)
        self.spec_draft_hit_num = Counter(
            "spec_draft_hit_num", "Draft tokens the model accepted", registry=r)
        self.spec_draft_acceptance_rate = Gauge(
            "spec_draft_acceptance_rate", "Accepted draft tokens over verified ones", registry=r)
        self.spec_mean_accepted_length = Gauge(
            "spec_mean_accepted_length", "Tokens a request gains per verifying step (accepted drafts + 1)",
            registry=r)
        self.spec_draft_position_acceptance_rate = Gauge(
            "spec_draft_position_acceptance_rate", "Acceptance rate of the drafts at each position (0: the first)",
            ["position"], registry=r)

        # A prefill or decode node's KV transport (``ksana/disagg/kv_connector.py``), read at scrape time.
        self.kv_transfer_pair_num = Gauge(
            "kv_transfer_pair_num", "Prefill/decode pairs whose KV transport is connected", registry=r)
        self.kv_transfer_sent_num = Gauge(
            "kv_transfer_sent_num", "Prompts whose KV cache this prefill node sent", registry=r)
        self.kv_transfer_sent_bytes = Gauge(
            "kv_transfer_sent_bytes", "Bytes of KV cache this prefill node sent", registry=r)
        self.kv_transfer_send_seconds = Gauge(
            "kv_transfer_send_seconds", "Seconds this prefill node's sends took", registry=r)
        self.kv_transfer_received_num = Gauge(
            "kv_transfer_received_num", "Prompts whose KV cache this decode node received", registry=r)
        self.kv_transfer_received_bytes = Gauge(
            "kv_transfer_received_bytes", "Bytes of KV cache this decode node received", registry=r)

    def observe_spec(self, num_draft_tokens: int, num_accepted: int) -> None:
        spec = self.spec
        spec.observe(num_draft_tokens, num_accepted)
        self.spec_draft_token_num.inc(num_draft_tokens)
        self.spec_draft_hit_num.inc(num_accepted)
        self.spec_draft_acceptance_rate.set(spec.acceptance_rate)
        self.spec_mean_accepted_length.set(spec.mean_accepted_length)
        for position, rate in enumerate(spec.acceptance_by_position):
            self.spec_draft_position_acceptance_rate.labels(position=str(position)).set(rate)

    def set_kv_transfer_stats(self, connector: KVConnector) -> None:
        self.kv_transfer_pair_num.set(sum(connector.is_connected(key) for key in list(connector.pairs)))
        self.kv_transfer_sent_num.set(connector.num_sent)
        self.kv_transfer_sent_bytes.set(connector.bytes_sent)
        self.kv_transfer_send_seconds.set(connector.send_seconds)
        self.kv_transfer_received_num.set(connector.num_received)
        self.kv_transfer_received_bytes.set(connector.bytes_received)

    def set_cache_stats(self, stats: CacheStats) -> None:
        self.block_manager_total_block_num.set(stats.num_total_blocks)
        self.block_manager_free_block_num.set(stats.num_free_blocks)
        self.block_manager_used_block_num.set(stats.num_used_blocks)
        self.block_manager_request_num.set(stats.num_requests_with_blocks)
        self.prefix_cache_hit_block_num.set(stats.prefix_cache_hit_block_num)
        self.full_prompt_matched_req_num.set(stats.full_prompt_matched_req_num)

    def render(self) -> bytes:
        return generate_latest(self.registry)
