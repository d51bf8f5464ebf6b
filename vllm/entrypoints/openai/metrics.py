"""Prometheus metrics under upstream's names, in a registry per app (two servers in one process never collide;
several API server processes sum theirs through prometheus_client's multiprocess mode).

Gauges and token counters are read from `AsyncLLM.stats()` at scrape time, so they can never drift from the
engine; latency histograms are observed by the serving code as outputs arrive.
"""
from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, engine, model_name: str, show_hidden: bool = False) -> None:
        self.engine, self.labels, self.show_hidden = engine, {"model_name": model_name}, show_hidden

    def cache_info(self, s) -> dict[str, str]:
        cc = self.engine.config.cache_config
        return {"block_size": str(cc.block_size), "num_gpu_blocks": str(s.num_blocks),
                "num_state_slots": str(s.num_slots), "cache_dtype": "auto",
                "gpu_memory_utilization": str(cc.gpu_memory_utilization),
                "enable_prefix_caching": str(cc.enable_prefix_caching)}

    def collect(self):
        s = self.engine.stats()
        gauges = [("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
                  ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                  ("vllm:kv_cache_usage_perc", "Fraction of MLA cache blocks in use (1 = full).", s.kv_cache_usage),
                  ("vllm:state_slot_usage_perc", "Fraction of KDA state slots in use (1 = full).",
                   s.state_slot_usage),
                  ("vllm:num_free_blocks", "Free MLA cache blocks.", s.num_free_blocks),
                  ("vllm:num_free_state_slots", "Free KDA recurrent-state slots.", s.num_free_slots)]
        # In tokens, as upstream: a request's lookup at admission (again after a preemption) adds its prompt to
        # the queries and the tokens found to the hits; prompt_tokens_cached counts each request's hit once.
        prefix_cache = [("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                         s.prefix_cache_queries),
                        ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
                        ("vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache (each request's "
                         "once).", s.prompt_tokens_cached)]
        if self.show_hidden:  # --show-hidden-metrics-for-version: upstream's deprecated names, same values
            gauges.append(("vllm:gpu_cache_usage_perc", "Deprecated: vllm:kv_cache_usage_perc.", s.kv_cache_usage))
            prefix_cache += [("vllm:gpu_prefix_cache_queries", "Deprecated: vllm:prefix_cache_queries.",
                              s.prefix_cache_queries),
                             ("vllm:gpu_prefix_cache_hits", "Deprecated: vllm:prefix_cache_hits.",
                              s.prefix_cache_hits)]
        for name, doc, value in gauges:
            yield self._family(GaugeMetricFamily, name, doc, value)
        counters = [("vllm:prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total),
                    ("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total),
                    ("vllm:num_preemptions", "Requests preempted (to be recomputed).", s.num_preemptions_total),
                    *prefix_cache]
        spec = s.spec_decode
        if spec is not None:
            counters += [("vllm:spec_decode_num_drafts", "Verifications with at least one draft token.",
                          spec.num_drafts),
                         ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens),
                         ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)]
            if spec.num_unverified_draft_tokens is not None:  # adaptive verification's (not upstream's names)
                counters += [("vllm:spec_decode_num_unverified_draft_tokens", "Draft tokens adaptive verification "
                              "did not verify (counted as rejected).", spec.num_unverified_draft_tokens),
                             ("vllm:spec_decode_num_remeasure_steps", "Steps adaptive verification ran with every "
                              "draft to re-measure them.", spec.num_remeasure_steps)]
        for name, doc, value in counters:
            yield self._family(CounterMetricFamily, name, doc, value)
        if s.iteration_tokens is not None:
            h = HistogramMetricFamily("vllm:iteration_tokens_total",
                                      "Prompt tokens computed plus tokens generated, per engine step.",
                                      labels=list(self.labels))
            h.add_metric(list(self.labels.values()), s.iteration_tokens.cumulative(), s.iteration_tokens.total)
            yield h
        labels = self.cache_info(s)
        info = GaugeMetricFamily("vllm:cache_config_info", "The cache's configuration (value 1).",
                                 labels=list(labels))
        info.add_metric(list(labels.values()), 1)
        yield info
        if spec is not None:
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft.",
                                    labels=[*self.labels, "position"])
            for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
                c.add_metric([*self.labels.values(), str(pos)], value)
            yield c


    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family


class Metrics:
    def __init__(self, engine, model_name: str, show_hidden: bool = False) -> None:
        self.registry = CollectorRegistry()
        engine_metrics = _EngineCollector(engine, model_name, show_hidden)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # One of several API server processes (api_server_procs.py): the request metrics below go to files
            # there, and /metrics sums every process's; the engine's come from the core, the same in each.
            self.exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposed)
            self.exposed.register(engine_metrics)
        else:
            self.registry.register(engine_metrics)
            self.exposed = self.registry
        label = ["model_name"]

        def hist(name, doc):
            return Histogram(name, doc, label, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between successive tokens of a request.")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Time from request arrival to its last output.")
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Time per output token after the first.")
        self.phases = {phase: hist(f"vllm:request_{phase}_time_seconds", doc) for phase, doc in [
            ("queue", "Time from arrival to first being scheduled."),
            ("prefill", "Time from first being scheduled to the first token."),
            ("decode", "Time from the first token to the last."),
            ("inference", "Time from first being scheduled to the last token.")]}

        def sizes(name, doc):
            return Histogram(name, doc, label, buckets=_TOKEN_BUCKETS, registry=self.registry).labels(model_name)
        self.prompt_tokens = sizes("vllm:request_prompt_tokens", "Prompt tokens per request.")
        self.generation_tokens = sizes("vllm:request_generation_tokens", "Generated tokens per request (all samples).")
        self.max_generation_tokens = sizes("vllm:request_max_num_generation_tokens",
                                           "The longest sample's generated tokens per request.")
        self.params_max_tokens = sizes("vllm:request_params_max_tokens", "max_tokens per request.")
        self.params_n = Histogram("vllm:request_params_n", "n per request.", label, buckets=(1, 2, 5, 10, 20),
                                  registry=self.registry).labels(model_name)
        self.model_name = model_name

    def render(self) -> bytes:
        return generate_latest(self.exposed)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latencies of one engine request, measured where the server sees its outputs."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics, self.start, self.last, self.tokens = metrics, time.monotonic(), None, 0

    def update(self, num_tokens: int) -> None:
        """`num_tokens`: the longest completion so far (n > 1 samples decode in lockstep)."""
        new = num_tokens - self.tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            gap = (now - self.last) / new  # outputs can batch several tokens: spread the gap over them
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self.last, self.tokens = now, num_tokens

    def finish(self, out: RequestOutput, params: SamplingParams, generated: list[int]) -> None:
        """`out`: the request's last output (its engine timestamps); `generated`: tokens per sample."""
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.start)
        for c in out.outputs:
            m.success.labels(m.model_name, c.finish_reason or "abort").inc()
        m.prompt_tokens.observe(len(out.prompt_token_ids))
        m.generation_tokens.observe(sum(generated))
        m.max_generation_tokens.observe(max(generated, default=0))
        m.params_n.observe(params.n)
        if params.max_tokens is not None:
            m.params_max_tokens.observe(params.max_tokens)
        t = out.metrics
        if t is None or t.first_scheduled_time is None:
            return
        m.phases["queue"].observe(t.first_scheduled_time - t.arrival_time)
        if t.first_token_time is not None and t.last_token_time is not None:
            m.phases["prefill"].observe(t.first_token_time - t.first_scheduled_time)
            m.phases["decode"].observe(t.last_token_time - t.first_token_time)
            m.phases["inference"].observe(t.last_token_time - t.first_scheduled_time)
            if max(generated, default=0) > 1:
                m.tpot.observe((t.last_token_time - t.first_token_time) / (max(generated) - 1))
