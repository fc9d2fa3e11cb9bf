"""Prometheus metrics of a served engine, with vLLM's names under the ``pagedtree:`` prefix.

Each server app owns its own ``CollectorRegistry``, so several apps (or tests) in one
process never clash on metric names. Engine counters are read from the engine's stats
snapshot at scrape time; latency histograms are fed by the engine's metrics listener
when each request ends.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedtree.engine.async_engine import AsyncEngine
from pagedtree.engine.async_stream import RequestMetrics
from pagedtree.host_memory import heap_stats

PREFIX = "pagedtree:"

# vLLM's buckets: latencies from a few ms (a decode step) to minutes (a long request).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Gauges and counters read when Prometheus scrapes: request counts live from the
    ``AsyncEngine``, the rest from its stats snapshot (``AsyncEngine.stats()``).

    The speculative-decoding keys (``num_drafts``, ``num_draft_tokens``,
    ``num_accepted_tokens``, ``accepted_tokens_per_position``) read as 0 / empty
    when the engine does not report them.
    """

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        # Describing nothing keeps registration from calling collect() on a live engine.
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, float(value or 0))
            return family

        def counter(name: str, doc: str, value: Any) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, float(value or 0))
            return family

        # Counted on the serving side as requests come and go, so the gauges do not
        # wait for the engine's next snapshot (a long step would freeze them).
        waiting = self.engine.num_waiting_requests
        running = self.engine.num_active_requests - waiting
        yield gauge("num_requests_running", "Requests generating (past their first token).", running)
        yield gauge("num_requests_waiting", "Requests accepted and waiting for their first token.", waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats.get("kv_cache_usage"))
        yield counter("prefix_cache_queries", "Prompt blocks looked up in the prefix cache.", stats.get("prefix_cache_queries"))
        yield counter("prefix_cache_hits", "Prompt blocks found in the prefix cache.", stats.get("prefix_cache_hits"))
        yield counter("prompt_tokens", "Prompt tokens received.", stats.get("num_prompt_tokens"))
        yield counter("generation_tokens", "Tokens generated.", stats.get("num_generated_tokens"))
        yield counter("num_preemptions", "Requests preempted to free KV blocks.", stats.get("num_preemptions"))
        yield counter("spec_decode_num_drafts", "Speculative draft trees verified.", stats.get("num_drafts", 0))
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.get("num_draft_tokens", 0))
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.get("num_accepted_tokens", 0))
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each depth of the draft.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(stats.get("accepted_tokens_per_position", []) or []):
            per_pos.add_metric([self.model_name, str(position)], float(count))
        yield per_pos
        # Read live from the grammar cache and compile service (thread-safe), else
        # from the snapshot.
        grammars = getattr(self.engine, "grammars", None)
        grammar = grammars.stats() if grammars is not None else stats
        yield gauge("grammar_cache_entries", "Compiled grammars cached.", grammar.get("grammar_cache_entries"))
        yield gauge("grammar_cache_bytes", "Bytes of the compiled grammars cached.", grammar.get("grammar_cache_bytes"))
        yield counter("grammar_cache_hits", "Constraints answered from the grammar cache.",
                      grammar.get("grammar_cache_hits"))
        yield counter("grammars_compiled", "Constraints compiled.", grammar.get("grammars_compiled"))
        yield gauge("grammar_compile_queue", "Grammar compiles waiting for a compile worker.",
                    grammar.get("grammar_compile_queue"))
        yield gauge("grammar_compiles_running", "Grammar compiles running in a compile worker.",
                    grammar.get("grammar_compiles_running"))
        yield counter("grammar_compiles_killed", "Grammar compiles killed: past their time limit, or abandoned by "
                      "every request waiting for them.", grammar.get("grammar_compiles_killed"))
        yield counter("grammar_compiles_refused", "Grammar compiles refused because the queue was full for the "
                      "server or the client (HTTP 429).", grammar.get("grammar_compiles_refused"))
        yield gauge("grammar_worker_rss_bytes", "Resident memory of the grammar compile worker processes.",
                    grammar.get("grammar_worker_rss_bytes"))
        yield from self._memory(stats)

    def _memory(self, stats: dict[str, Any]) -> Iterator[Metric]:
        """Where the process's memory is (the RSS itself is ``process_resident_memory_bytes``)."""
        heap = heap_stats()
        if heap is not None:
            family = GaugeMetricFamily(PREFIX + "malloc_bytes", "glibc heap over all arenas: in use, in free "
                                       "chunks (an upper bound on what malloc_trim can hand back: pages it "
                                       "already returned still count), mapped one by one.",
                                       labels=["model_name", "state"])
            for state, value in (("in_use", heap.in_use), ("free", heap.free), ("mmapped", heap.mmapped)):
                family.add_metric([self.model_name, state], float(value))
            yield family
        blocks = GaugeMetricFamily(PREFIX + "python_allocated_blocks",
                                   "Memory blocks the Python interpreter has allocated (objects and buffers).",
                                   labels=["model_name"])
        blocks.add_metric([self.model_name], float(sys.getallocatedblocks()))
        yield blocks
        if "suffix_global_nodes" in stats:
            nodes = GaugeMetricFamily(PREFIX + "suffix_tree_nodes", "Nodes of the suffix drafter's trees: the "
                                      "global tree of recent outputs, and the running requests' own trees.",
                                      labels=["model_name", "tree"])
            nodes.add_metric([self.model_name, "global"], float(stats.get("suffix_global_nodes", 0)))
            nodes.add_metric([self.model_name, "requests"], float(stats.get("suffix_request_nodes", 0)))
            yield nodes
        trims = CounterMetricFamily(PREFIX + "malloc_trims", "Times the engine handed free heap back to the OS.",
                                    labels=["model_name"])
        trims.add_metric([self.model_name], float(stats.get("num_heap_trims", 0)))
        yield trims


class ServerMetrics:
    """The registry of one server app: engine counters plus request-latency histograms."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(engine, model_name))
        # process_resident_memory_bytes, process_cpu_seconds_total, open fds, ...
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.",
            labels, registry=self.registry, buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between successive engine outputs of a request.",
            labels, registry=self.registry, buckets=ITL_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.",
            labels, registry=self.registry, buckets=E2E_BUCKETS,
        ).labels(model_name)
        self.finished = Counter(
            PREFIX + "request_success", "Requests ended, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self.http_errors = Counter(
            PREFIX + "http_errors", "Requests answered with an HTTP error, by status.",
            ["model_name", "status"], registry=self.registry,
        )

    def observe(self, metrics: RequestMetrics) -> None:
        """Record one ended request (an ``AsyncEngine`` metrics listener)."""
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        for latency in metrics.inter_token_latencies:
            self.itl.observe(latency)
        if metrics.e2e_latency is not None:
            self.e2e.observe(metrics.e2e_latency)
        self.finished.labels(self.model_name, metrics.finish_reason or "unknown").inc()

    def count_error(self, status: int) -> None:
        """Count an HTTP error response."""
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in the registry."""
        return generate_latest(self.registry)
