"""Prometheus metrics: what the HTTP layer observes, plus the service's own counters at scrape time.

Each app has its own registry, so several apps (tests) never share or clash. Gauges and
counters owned by the runtime (queue, pages, tokens) are read from GenerateService.stats()
when /metrics is scraped, never copied. Every sample carries `model_name` (the first served
name, as /v1/models lists it), as vLLM's do, so dashboards built for vLLM can select Kiln's
series the same way; names follow Prometheus' rules (`_total` only on counters).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kiln.runtime.request import Request
from kiln.runtime.service import GenerateService

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKENS_PER_FORWARD_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 60.0, 120.0)
# Tokens per request: 1, 2, 5, 10, ... (vLLM's spacing), past any context length.
_TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


class ServiceCollector(Collector):
    """The service's queue, pages and token counters, read at each scrape."""

    def __init__(self, service: GenerateService):
        self.service = service

    def collect(self):
        stats = self.service.stats()
        gauges = {
            "kiln_requests_waiting": ("requests waiting to be scheduled (the queue)", stats.waiting_requests),
            "kiln_sequences_running": ("sequences holding KV pages (prefilling or decoding)", stats.running_sequences),
            "kiln_kv_pages_capacity": ("KV-cache pages a request can get", stats.pages_total),
            "kiln_kv_pages_free": ("KV-cache pages never allocated or released", stats.pages_free),
            "kiln_kv_pages_cached": ("KV-cache pages held only by the prefix cache (evictable)", stats.pages_cached),
            "kiln_kv_pages_active": ("KV-cache pages referenced by requests in flight", stats.pages_active),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(name, documentation, value=value)
        ready = GaugeMetricFamily("kiln_service_state", "1 for the service's current state", labels=["state"])
        ready.add_metric([stats.state], 1)
        yield ready
        counters = {
            "kiln_prompt_tokens": ("prompt tokens submitted", stats.prompt_tokens),
            "kiln_generation_tokens": ("tokens generated", stats.generated_tokens),
            "kiln_prefix_cache_hit_tokens": ("prompt tokens served from the prefix cache", stats.prefix_hit_tokens),
            "kiln_preemptions": ("sequences preempted for lack of KV pages", stats.preemptions),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(name, documentation, value=value)
        steps = CounterMetricFamily("kiln_model_steps", "batches run on the device, by kind", labels=["kind"])
        for kind, count in stats.steps.items():
            steps.add_metric([kind], count)
        yield steps
        if stats.forward_passes is not None:
            yield from diffusion_metrics(stats)
        if stats.speculation is not None:
            yield from speculative_metrics(stats.speculation)
        if stats.host_pages_total:
            yield from host_tier_metrics(stats)
        yield from vllm_metrics(stats)


def vllm_metrics(stats):
    """The series vLLM exposes that routers read (llm-d's endpoint picker, vLLM's production-stack
    router), under vLLM's names, so they route to Kiln as to vLLM."""
    for name, documentation, value in (
        ("vllm:num_requests_running", "requests with a sequence in model execution", stats.running_requests),
        ("vllm:num_requests_waiting", "requests waiting to be scheduled", stats.waiting_requests),
        ("vllm:kv_cache_usage_perc", "fraction of KV-cache pages in use by requests (1 = full)",
         stats.pages_active / stats.pages_total if stats.pages_total else 0.0),
    ):
        yield GaugeMetricFamily(name, documentation, value=value)
    yield CounterMetricFamily("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                              value=stats.prompt_tokens)
    yield CounterMetricFamily("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache",
                              value=stats.prefix_hit_tokens)


def host_tier_metrics(stats):
    """The host KV tier (and the disk tier under it): its pages, the prompt tokens each tier
    served (and those computed), the bytes copied each way, the disk's pages."""
    yield GaugeMetricFamily("kiln_kv_host_pages_capacity", "host KV tier pages", value=stats.host_pages_total)
    yield GaugeMetricFamily("kiln_kv_host_pages_used", "host KV tier pages holding a page's K/V",
                            value=stats.host_pages_used)
    tiers = CounterMetricFamily("kiln_prefix_cache_tier_tokens", "prompt tokens by where their K/V came from: "
                                "device pages, copied back from host memory, or computed (miss)", labels=["tier"])
    device = stats.prefix_hit_tokens - stats.host_hit_tokens - stats.disk_hit_tokens
    tiers.add_metric(["device"], device)
    tiers.add_metric(["host"], stats.host_hit_tokens)
    tiers.add_metric(["disk"], stats.disk_hit_tokens)
    tiers.add_metric(["miss"], max(0, stats.prompt_tokens - stats.prefix_hit_tokens))
    yield tiers
    if stats.disk_pages:
        disk = CounterMetricFamily("kiln_kv_disk_pages", "disk KV tier pages written, read back, and refused "
                                   "(files that did not check out)", labels=["event"])
        for event, count in stats.disk_pages.items():
            disk.add_metric([event], count)
        yield disk
        yield GaugeMetricFamily("kiln_kv_disk_pages_stored", "disk KV tier pages of this model in its directory",
                                value=stats.disk_pages_stored)
    copied = CounterMetricFamily("kiln_kv_copied_bytes", "KV bytes copied between the device and the host tier",
                                 labels=["direction"])
    copied.add_metric(["to_host"], stats.bytes_to_host)
    copied.add_metric(["to_device"], stats.bytes_to_device)
    yield copied


def diffusion_metrics(stats):
    """A diffusion LM's forward passes per sequence, by what they computed, and the tokens each committed."""
    passes = CounterMetricFamily("kiln_diffusion_forward_passes", "a diffusion LM's forward passes per sequence, "
                                 "by window: full sequence, cached prefix, dual cache, APD round", labels=["kind"])
    for kind in ("full", "prefix", "dual", "apd"):
        passes.add_metric([kind], stats.forward_passes.get(kind, 0))
    yield passes
    committed = stats.committed_per_pass  # positions committed -> passes that committed that many
    cumulative = [(str(bound), sum(count for tokens, count in committed.items() if tokens <= bound))
                  for bound in _TOKENS_PER_FORWARD_BUCKETS]
    yield HistogramMetricFamily(
        "kiln_diffusion_tokens_per_forward", "positions a diffusion LM's forward pass committed, per sequence",
        buckets=cumulative + [("+Inf", sum(committed.values()))],
        sum_value=sum(tokens * count for tokens, count in committed.items()),
    )


def speculative_metrics(counters):
    """Speculative decoding's drafts and what was kept of them (vLLM's spec_decode counters)."""
    for name, documentation, value in (
        ("kiln_spec_decode_drafts", "decode rows that carried a draft into a verify call", counters.drafts),
        ("kiln_spec_decode_draft_tokens", "draft tokens proposed and verified", counters.draft_tokens),
        ("kiln_spec_decode_accepted_tokens", "draft tokens the model agreed with and kept", counters.accepted_tokens),
    ):
        yield CounterMetricFamily(name, documentation, value=value)
    yield GaugeMetricFamily("kiln_spec_decode_mean_accepted_length",
                            "tokens a drafted row gains per verify call (kept drafts + 1), since start",
                            value=counters.mean_accepted_length)


class ModelRegistry(CollectorRegistry):
    """A registry that labels every sample of every family with the model's name when it is
    collected: no metric (the runtime's, read at scrape time, included) can go out without it."""

    def __init__(self, model_name: str):
        super().__init__()
        self.model_name = model_name

    def collect(self):
        for metric in super().collect():  # fresh objects each scrape: relabelling them changes nothing kept
            metric.samples = [sample._replace(labels={"model_name": self.model_name, **sample.labels})
                              for sample in metric.samples]
            yield metric


class Metrics:
    def __init__(self, service: GenerateService, model_name: str):
        disable_created_metrics()  # no `_created` series beside every counter (process-wide, as intended here)
        self.registry = ModelRegistry(model_name)
        self.requests = Counter("kiln_requests", "HTTP requests by route and status",
                                ["route", "method", "status"], registry=self.registry)
        self.grpc_requests = Counter("kiln_grpc_requests", "gRPC calls by method and status code",
                                     ["method", "code"], registry=self.registry)
        self.time_to_first_token = Histogram("kiln_time_to_first_token_seconds",
                                             "from submission to a sequence's first token",
                                             buckets=_TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram("kiln_inter_token_latency_seconds",
                                             "between consecutive tokens of a sequence",
                                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.request_latency = Histogram("kiln_request_latency_seconds", "from submission to the last token",
                                         buckets=_TTFT_BUCKETS, registry=self.registry)
        self.finished = Counter("kiln_sequences_finished", "sequences finished, by reason", ["reason"],
                                registry=self.registry)
        # Per request (all its sequences), as vLLM's vllm:request_* histograms.
        self.request_queue_time = Histogram("kiln_request_queue_time_seconds",
                                            "from a request's arrival to its first sequence's admission to run",
                                            buckets=_TTFT_BUCKETS, registry=self.registry)
        self.request_prompt_tokens = Histogram("kiln_request_prompt_tokens", "prompt tokens of a finished request",
                                               buckets=_TOKEN_COUNT_BUCKETS, registry=self.registry)
        self.request_generation_tokens = Histogram("kiln_request_generation_tokens",
                                                   "tokens a finished request generated (all its sequences)",
                                                   buckets=_TOKEN_COUNT_BUCKETS, registry=self.registry)
        self.registry.register(ServiceCollector(service))

    def request_finished(self, request: Request, generation_tokens: int) -> None:
        """Observe a request whose every sequence has finished."""
        self.request_prompt_tokens.observe(len(request.prompt_ids))
        self.request_generation_tokens.observe(generation_tokens)
        if request.scheduled_at is not None:  # None: it failed before it ever ran
            self.request_queue_time.observe(request.scheduled_at - request.arrived_at)

    def render(self) -> bytes:
        return generate_latest(self.registry)
