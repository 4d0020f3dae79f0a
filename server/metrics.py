"""Prometheus metrics: the engine's counters as its thread last published them (a scrape never touches the
scheduler's live structures), request latencies observed by the server, and the worker process (RSS, CPU)."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxllm.engine.engine_client import EngineClient

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class EngineCollector:
    def __init__(self, loop: EngineClient, model_name: str):
        self.loop, self.labels = loop, [model_name]

    def collect(self):
        s = self.loop.stats

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(self.labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(self.labels, value)
            return c

        yield gauge("jaxllm_num_requests_running", "Sequences in the running batch.", s["num_running"])
        yield gauge("jaxllm_num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"])
        yield gauge("jaxllm_kv_cache_usage_perc", "Fraction of KV-cache pages in use.", s["kv_cache_usage"])
        yield gauge("jaxllm_kv_cache_free_pages", "KV-cache pages not held by any sequence.", s["num_free_pages"])
        yield gauge("jaxllm_kv_cache_pages", "KV-cache pages in all.", s["num_pages"])
        yield counter("jaxllm_prompt_tokens", "Prompt tokens received.", s["prompt_tokens_total"])
        yield counter("jaxllm_generation_tokens", "Tokens generated.", s["generation_tokens_total"])
        yield counter("jaxllm_num_preemptions", "Sequences preempted for lack of KV pages.", s["num_preemptions"])
        yield counter("jaxllm_num_failed_requests", "Requests ended by an error in their own handling.",
                      s["num_failed_requests"])
        yield counter("jaxllm_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      s["prefix_cache_hit_tokens_total"])
        yield counter("jaxllm_images_encoded", "Images the vision encoder ran on.", s.get("images_encoded_total", 0))
        yield counter("jaxllm_encoder_cache_hits", "Images whose embeddings a step found in the encoder cache.",
                      s.get("encoder_cache_hits_total", 0))
        if "spec_decode_num_drafts_total" in s:  # speculative decoding (vLLM's spec_decode metrics)
            for key, doc in (("num_drafts", "Sequence steps that verified drafts."),
                             ("num_draft_tokens", "Draft tokens proposed."),
                             ("num_accepted_tokens", "Draft tokens the target accepted."),
                             ("num_guessed_steps", "Drafted steps dispatched before the step they follow was read "
                              "back, on a guess of its tokens."),
                             ("num_guessed_steps_held", "Guessed steps whose guess held (the others were dropped).")):
                yield counter(f"jaxllm_spec_decode_{key}", doc, s[f"spec_decode_{key}_total"])
            per_pos = CounterMetricFamily("jaxllm_spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by draft position.",
                                          labels=["model_name", "position"])
            for position, count in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                per_pos.add_metric([*self.labels, str(position)], count)
            yield per_pos
        if "lora_max_loras" in s:  # an engine with LoRA adapters
            yield from self._lora(s)
        # Per engine core (data-parallel rank; one when there is no data parallelism).
        per_rank = [("jaxllm_engine_requests", "Requests this engine core received.", "requests_total", True),
                    ("jaxllm_engine_num_requests_running", "Sequences in this engine core's batch.", "num_running",
                     False),
                    ("jaxllm_engine_num_requests_waiting", "Requests waiting on this engine core.", "num_waiting",
                     False),
                    ("jaxllm_engine_generation_tokens", "Tokens this engine core generated.",
                     "generation_tokens_total", True),
                    ("jaxllm_engine_prefix_cache_hit_tokens", "Prompt tokens this engine core served from its prefix "
                     "cache.", "prefix_cache_hit_tokens_total", True)]
        ranks = self.loop.rank_stats
        for name, doc, key, is_counter in per_rank:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, doc,
                                                                              labels=["model_name", "engine"])
            for rank, rs in enumerate(ranks):
                family.add_metric([*self.labels, str(rank)], rs.get(key, 0))
            yield family


    def _lora(self, s: dict):
        running, waiting = s.get("lora_requests_running", {}), s.get("lora_requests_waiting", {})
        info = GaugeMetricFamily("jaxllm_lora_requests_info", "The adapters of running and waiting requests "
                                 "(vLLM's lora_requests_info); the value is when it was read.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(s["lora_max_loras"]), ",".join(sorted(running)), ",".join(sorted(waiting))], time.time())
        yield info
        for key, counts, doc in (("running", running, "Requests running, by LoRA adapter."),
                                 ("waiting", waiting, "Requests waiting, by LoRA adapter.")):
            family = GaugeMetricFamily(f"jaxllm_lora_num_requests_{key}", doc, labels=["model_name", "lora_name"])
            for name in sorted(counts):
                family.add_metric([*self.labels, name], counts[name])
            yield family


def shared_across_workers() -> bool:
    """Whether histograms go to prometheus_client's per-process files (several API workers; server.gunicorn_config
    sets the directory before forking them)."""
    shared = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir"))
    if shared and not getattr(values.ValueClass, "_multiprocess", False):
        raise RuntimeError("prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set: this worker's "
                           "latencies would be missing from the other workers' /metrics")
    return shared


class ServerMetrics:
    """The engine's counters (from its published stats) and the server's latency histograms. With several API
    workers the histograms are summed over every worker's files at each scrape, so whichever worker answers
    /metrics counts all requests; the engine's counters come from the shared engine core either way."""

    def __init__(self, loop: EngineClient, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(loop, model_name))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, process_cpu_seconds_total...
        shared = shared_across_workers()
        if shared:
            multiprocess.MultiProcessCollector(self.registry)
        # Shared: written to this process's file (read back by the collector above), registered nowhere.
        kw = dict(labelnames=["model_name"], registry=None if shared else self.registry, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("jaxllm_time_to_first_token_seconds", "Time to first token.", **kw).labels(model_name)
        self.itl = Histogram("jaxllm_inter_token_latency_seconds", "Time between streamed outputs.",
                             **kw).labels(model_name)
        self.e2e = Histogram("jaxllm_e2e_request_latency_seconds", "Request latency, end to end.",
                             **kw).labels(model_name)
