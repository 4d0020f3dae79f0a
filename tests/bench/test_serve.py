"""The benchmark's arithmetic, on results whose times are known: vLLM's metric names and definitions (TTFT,
TPOT after the first token, ITL between chunks, E2EL; mean/median/std/percentiles in ms), throughputs, peaks,
failed requests kept out of the metrics, and the arrival process."""

import numpy as np
import pytest

from jaxllm.bench.datasets import SampleRequest
from jaxllm.bench.serve import RequestResult, Target, arrival_gaps, format_result, summarize


def result(start, ttft, latency, tokens, prompt_len=10):
    chunks = list(np.linspace(start + ttft, start + latency, tokens))
    return RequestResult(prompt_len=prompt_len, success=True, ttft=ttft, latency=latency, output_tokens=tokens,
                         itl=[b - a for a, b in zip(chunks, chunks[1:], strict=False)], start=start, chunk_times=chunks,
                         generated_text="x" * tokens)


def test_metrics_follow_vllm_definitions():
    rs = [result(0.0, 0.1, 1.1, 11), result(0.0, 0.2, 2.2, 21), result(0.5, 0.3, 0.8, 6),
          RequestResult(prompt_len=7, error="HTTP 500: boom", start=0.6)]
    out = summarize(rs, duration=2.0, request_rate=4.0, burstiness=1.0, max_concurrency=None, percentiles=(50, 99))
    assert out["completed"] == 3 and out["failed"] == 1 and out["num_prompts"] == 4
    assert out["total_input_tokens"] == 30 and out["total_output_tokens"] == 38
    assert out["request_throughput"] == pytest.approx(1.5) and out["output_throughput"] == pytest.approx(19.0)
    assert out["total_token_throughput"] == pytest.approx(34.0)
    assert out["mean_ttft_ms"] == pytest.approx(200.0) and out["median_ttft_ms"] == pytest.approx(200.0)
    assert out["p50_ttft_ms"] == pytest.approx(200.0) and out["p99_ttft_ms"] == pytest.approx(298.0)
    assert out["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300]))
    assert out["mean_tpot_ms"] == pytest.approx(100.0)  # (1.1 - 0.1) / 10, (2.2 - 0.2) / 20, (0.8 - 0.3) / 5
    assert out["median_itl_ms"] == pytest.approx(100.0) and out["max_output_tokens_per_s"] >= 11
    assert out["mean_e2el_ms"] == pytest.approx((1100 + 2200 + 800) / 3)
    assert out["max_concurrent_requests"] == 4  # the failed one was in flight too, from 0.6 on
    assert out["errors"] == ["", "", "", "HTTP 500: boom"] and out["output_lens"] == [11, 21, 6, 0]
    text = format_result(out, ["ttft", "tpot", "itl", "e2el"], (50, 99))
    for line in ["Serving Benchmark Result", "Successful requests:                     3",
                 "Failed requests:                         1", "Request rate configured (RPS):           4.00",
                 "Output token throughput (tok/s):         19.00", "Mean TTFT (ms):                          200.00",
                 "P99 TTFT (ms):                           298.00", "Median TPOT (ms):", "P50 ITL (ms):",
                 "End-to-end Latency"]:
        assert line in text, text


def test_all_failed_is_all_zero_not_an_error():
    out = summarize([RequestResult(prompt_len=3, error="x")], 1.0, request_rate=float("inf"), burstiness=1.0,
                    max_concurrency=2)
    assert out["completed"] == 0 and out["mean_ttft_ms"] == 0.0 and out["p99_itl_ms"] == 0.0
    assert "Maximum request concurrency:             2" in format_result(out)


def test_arrivals():
    assert arrival_gaps(5, float("inf"), 1.0, 0) == [0.0] * 5
    poisson = np.array(arrival_gaps(20000, 4.0, 1.0, 0))
    bursty = np.array(arrival_gaps(20000, 4.0, 0.25, 0))
    assert poisson.mean() == pytest.approx(0.25, rel=0.03) and bursty.mean() == pytest.approx(0.25, rel=0.06)
    assert poisson.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    assert bursty.std() > 1.8 * poisson.std()  # gamma shape 0.25: cv = 2
    assert arrival_gaps(10, 2.0, 1.0, 7) == arrival_gaps(10, 2.0, 1.0, 7)
    with pytest.raises(ValueError):
        arrival_gaps(3, 1.0, 0.0, 0)


def test_request_bodies():
    req = SampleRequest("hi", 1, 8)
    t = Target("http://h:1/", "/v1/completions", "m", ignore_eos=True, api_key="k")
    assert t.url == "http://h:1/v1/completions" and t.headers() == {"Authorization": "Bearer k"}
    assert t.body(req) == {"model": "m", "stream": True, "stream_options": {"include_usage": True},
                           "temperature": 0.0, "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
    chat = Target("http://h:1", "/v1/chat/completions", "m", backend="openai-chat", sampling={"temperature": 1.0})
    body = chat.body(req)
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 8
    assert "ignore_eos" not in body and chat.headers() == {}
    with pytest.raises(ValueError, match="backend"):
        Target("http://h", "/x", "m", backend="tgi")
