"""A serving benchmark against any OpenAI-compatible server (jaxllm, vLLM, llama.cpp's llama-server), measured
as ``vllm bench serve`` measures: streaming requests sent at a request rate (Poisson arrivals, or gamma with
``burstiness`` != 1; ``inf``: all at once), optionally at most ``max_concurrency`` in flight, and for each
request the time to first token (TTFT), time per output token after the first (TPOT), the gaps between streamed
chunks (ITL) and end-to-end latency (E2EL). The result carries vLLM's names (``mean_ttft_ms``,
``p99_itl_ms``, ``output_throughput``...), so a file saved here reads like one saved by vLLM."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import numpy as np
import requests

from jaxllm.bench.datasets import SampleRequest
from jaxllm.tokenizer.tokenizer import Tokenizer

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0  # s, from sending it (as vLLM: a --max-concurrency wait before is not counted)
    itl: list[float] = dataclasses.field(default_factory=list)  # s between streamed chunks after the first
    latency: float = 0.0  # s, sending to the last byte
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    start: float = 0.0  # perf_counter when sent
    chunk_times: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where requests go and what they ask for."""

    base_url: str
    endpoint: str
    model: str
    backend: str = "openai"
    api_key: str | None = None
    ignore_eos: bool = False
    sampling: dict = dataclasses.field(default_factory=lambda: {"temperature": 0.0})

    def __post_init__(self):
        if self.backend not in ENDPOINTS:
            raise ValueError(f"backend must be one of {sorted(ENDPOINTS)}, got {self.backend!r}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def body(self, req: SampleRequest) -> dict:
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}, **self.sampling}
        if self.backend == "openai-chat":
            body |= {"messages": [{"role": "user", "content": req.prompt}],
                     "max_completion_tokens": req.expected_output_len}
        else:
            body |= {"prompt": req.prompt, "max_tokens": req.expected_output_len}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and llama-server's extension; jaxllm has it too
        return body

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _chunk_text(chunk: dict, chat: bool) -> str | None:
    """The output a chunk carries (None: none; "" for output that renders as nothing, e.g. a tool call's)."""
    choices = chunk.get("choices") or []
    if not choices:
        return None
    if not chat:
        return choices[0].get("text") or None
    delta = choices[0].get("delta") or {}
    if delta.get("content"):
        return delta["content"]
    return "" if delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls") else None


def send(target: Target, req: SampleRequest, session: requests.Session,
         count: Callable[[str], int] | None = None) -> RequestResult:
    """One streamed request; every failure (HTTP status, a broken stream, an error event) is the result's error.
    Output tokens: the server's `usage` (asked for with stream_options), else `count` of the text, else the
    number of streamed chunks."""
    arrival = time.perf_counter()
    out = RequestResult(prompt_len=req.prompt_len, start=arrival)
    chat = target.backend == "openai-chat"
    text = []
    usage_tokens = None
    done = False
    try:
        with session.post(target.url, json=target.body(req), headers=target.headers(), stream=True,
                          timeout=(30, 6 * 3600)) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:200]
                    return out
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                piece = _chunk_text(chunk, chat)
                if piece is not None:
                    now = time.perf_counter()
                    if out.chunk_times:
                        out.itl.append(now - out.chunk_times[-1])
                    else:
                        out.ttft = now - arrival
                    out.chunk_times.append(now)
                    text.append(piece)
    except (requests.RequestException, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
        return out
    out.latency = time.perf_counter() - arrival
    out.generated_text = "".join(text)
    out.output_tokens = usage_tokens if usage_tokens is not None else \
        count(out.generated_text) if count is not None else len(out.chunk_times)
    if not done:
        out.error = "the stream ended without [DONE]"
    elif not out.output_tokens:
        out.error = "the stream carried no tokens"
    else:
        out.success = True
        if not out.chunk_times:  # tokens that render as no text (on the chat endpoint): seen only at the end
            out.ttft = out.latency
    return out


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between arrivals: gamma with shape `burstiness` and mean 1/rate (burstiness 1: Poisson)."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = np.random.default_rng(seed)
    return list(rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n))


def run(target: Target, reqs: Sequence[SampleRequest], *, request_rate: float = float("inf"),
        burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
        tokenizer: Tokenizer | None = None, progress: bool = False, percentiles: Sequence[float] = (99,)) -> dict:
    """Sends `reqs` and returns vLLM's result dict (metrics in ms, throughputs per s, per-request lists)."""
    from tqdm import tqdm

    count = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer else None
    local = threading.local()
    bar = tqdm(total=len(reqs), disable=not progress, desc="requests")

    def task(req: SampleRequest) -> RequestResult:
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        result = send(target, req, session, count)
        bar.update(1)
        return result

    gaps = arrival_gaps(len(reqs), request_rate, burstiness, seed)
    start = time.perf_counter()
    # the pool's size is the concurrency limit: a request waits for a free thread before it is sent (and timed)
    with ThreadPoolExecutor(min(len(reqs), max_concurrency or len(reqs), 1024)) as pool:
        futures = []
        for req, gap in zip(reqs, gaps, strict=True):
            futures.append(pool.submit(task, req))
            if gap:
                time.sleep(gap)
        results = [f.result() for f in futures]
    duration = time.perf_counter() - start
    bar.close()
    return summarize(results, duration, request_rate=request_rate, burstiness=burstiness,
                     max_concurrency=max_concurrency, percentiles=percentiles)


def _peaks(results: list[RequestResult]) -> tuple[float, int]:
    """The most chunks that arrived within one second, and the most requests in flight at once."""
    times = sorted(t for r in results for t in r.chunk_times)
    peak_tokens = 0
    lo = 0
    for hi, t in enumerate(times):
        while times[lo] < t - 1.0:
            lo += 1
        peak_tokens = max(peak_tokens, hi - lo + 1)
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results if r.success])
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    return float(peak_tokens), peak


def summarize(results: list[RequestResult], duration: float, *, request_rate: float, burstiness: float,
              max_concurrency: int | None, percentiles: Sequence[float] = (99,)) -> dict:
    ok = [r for r in results if r.success]
    metric_values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    peak_tokens, peak_requests = _peaks(results)
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "duration": duration, "completed": len(ok),
        "failed": len(results) - len(ok), "num_prompts": len(results), "request_rate": request_rate,
        "burstiness": burstiness, "max_concurrency": max_concurrency,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_requests,
    }
    for name, values in metric_values.items():
        ms = np.asarray(values, np.float64) * 1e3
        out[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        out[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        out[f"std_{name}_ms"] = float(ms.std()) if ms.size else 0.0
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    out |= {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results]}
    return out


def format_result(result: dict, metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                  percentiles: Sequence[float] = (99,)) -> str:
    """vLLM's printed summary."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")

    row("Successful requests:", result["completed"])
    if result["failed"]:
        row("Failed requests:", result["failed"])
    if result["max_concurrency"] is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result["request_rate"] != float("inf"):
        row("Request rate configured (RPS):", float(result["request_rate"]))
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for name in metrics:
        lines.append("{s:{c}^{n}}".format(s=METRICS[name], n=50, c="-"))
        short = name.upper()
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", result[f"p{p:g}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)
