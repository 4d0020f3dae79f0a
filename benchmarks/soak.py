"""Soak test of a running server: many requests with random sampling parameters, some clients walking away
mid-answer, /health polled throughout. Reports (and checks) failed requests, leaked KV pages, stuck requests,
the worker's memory growth and /health latency.

    gunicorn server.app:app &
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --requests 1000 --json out/soak.json

A warm-up round (one request per client) runs first; the worker's RSS (process_resident_memory_bytes from
/metrics) after it is the baseline for the growth figure. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

TOPICS = ["the sea", "a city at night", "a forest", "the moon", "a robot", "music", "rain", "a library",
          "bread", "a mountain", "a train", "winter"]


@dataclass
class Outcome:
    kind: str  # "ok", "disconnected", "failed"
    detail: str = ""
    seconds: float = 0.0


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name (labels dropped): value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def metrics(base: str) -> dict[str, float]:
    return parse_metrics(requests.get(base + "/metrics", timeout=10).text)


def random_request(rng: random.Random) -> tuple[str, dict]:
    body: dict = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.3, 0.7, 1.0, 1.5]),
                  "seed": rng.randrange(1 << 63), "stream": rng.random() < 0.7}
    if rng.random() < 0.3:
        body["top_p"] = rng.uniform(0.5, 1.0)
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([1, 5, 40])
    if rng.random() < 0.2:
        body["presence_penalty"] = rng.uniform(-1, 1)
        body["frequency_penalty"] = rng.uniform(-1, 1)
    if rng.random() < 0.1:
        body["repetition_penalty"] = rng.uniform(0.8, 1.3)
    if rng.random() < 0.2:
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.2:
        body["stop"] = rng.sample([".", "\n", " the", "!"], k=rng.randint(1, 2))
    if rng.random() < 0.15:
        body["logit_bias"] = {str(rng.randrange(49152)): rng.uniform(-100, 100) for _ in range(rng.randint(1, 20))}
    if rng.random() < 0.1:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    topic = rng.choice(TOPICS)
    if rng.random() < 0.5:
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
        body["messages"] = [{"role": "user", "content": f"Write about {topic}."}]
        return "/v1/chat/completions", body
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    body["prompt"] = f"A short note about {topic}:"
    return "/v1/completions", body


def run_one(base: str, headers: dict, seed: int, disconnect: bool) -> Outcome:
    rng = random.Random(seed)
    path, body = random_request(rng)
    start = time.monotonic()
    try:
        if body["stream"]:
            with requests.post(base + path, json=body, headers=headers, stream=True, timeout=120) as r:
                if r.status_code != 200:
                    return Outcome("failed", f"{r.status_code} {r.text[:200]}")
                chunks, done = 0, False
                cut_after = rng.randint(1, 4) if disconnect else None
                for line in r.iter_lines():
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: "):
                        if b'"error"' in line[:20]:
                            return Outcome("failed", line.decode()[:200])
                        chunks += 1
                        if cut_after is not None and chunks >= cut_after:
                            r.close()  # walk away mid-stream
                            return Outcome("disconnected", seconds=time.monotonic() - start)
                if cut_after is not None:  # the answer was shorter than the cut point
                    return Outcome("ok", seconds=time.monotonic() - start)
                return Outcome("ok" if done else "failed", "" if done else "stream ended without [DONE]",
                               time.monotonic() - start)
        if disconnect:  # give up on a non-streaming request: the read times out and the connection closes
            try:
                r = requests.post(base + path, json=body, headers=headers, timeout=(10, rng.uniform(0.05, 0.5)))
            except requests.exceptions.ReadTimeout:
                return Outcome("disconnected", seconds=time.monotonic() - start)
        else:
            r = requests.post(base + path, json=body, headers=headers, timeout=120)
        if r.status_code != 200:
            return Outcome("failed", f"{r.status_code} {r.text[:200]}")
        choices = r.json()["choices"]
        bad = [c["finish_reason"] for c in choices if c["finish_reason"] not in ("stop", "length")]
        return Outcome("failed" if bad else "ok", f"finish reasons {bad}" if bad else "", time.monotonic() - start)
    except requests.RequestException as e:
        return Outcome("failed", repr(e)[:200], time.monotonic() - start)


def soak(base: str, api_key: str | None, num_requests: int, concurrency: int, disconnect_fraction: float,
         seed: int) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    with ThreadPoolExecutor(concurrency) as pool:  # warm-up: one request per client, none dropped
        list(pool.map(lambda i: run_one(base, headers, seed * 7919 + i, False), range(concurrency)))
    wait_idle(base, 30)
    warm = metrics(base)
    rss_warm = warm["process_resident_memory_bytes"]

    health: list[float] = []
    health_errors: list[str] = []
    stop = threading.Event()

    def poll_health():
        with requests.Session() as s:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    if s.get(base + "/health", timeout=10).status_code != 200:
                        health_errors.append("status")
                except requests.RequestException as e:
                    health_errors.append(repr(e))
                health.append(time.monotonic() - t)
                time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    plan = [(rng.randrange(1 << 62), rng.random() < disconnect_fraction) for _ in range(num_requests)]
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda p: run_one(base, headers, *p), plan))
    finally:
        stop.set()
        poller.join()
    wall = time.monotonic() - start
    idle_after = wait_idle(base, 10)
    m = metrics(base)
    failed = [o.detail for o in outcomes if o.kind == "failed"]
    health_sorted = sorted(health)
    return {
        "requests": num_requests, "concurrency": concurrency, "disconnect_fraction": disconnect_fraction,
        "seed": seed, "wall_s": round(wall, 1),
        "ok": sum(o.kind == "ok" for o in outcomes), "disconnected": sum(o.kind == "disconnected" for o in outcomes),
        "failed": len(failed), "failures": failed[:10],
        "stuck_requests": m["jaxllm_num_requests_running"] + m["jaxllm_num_requests_waiting"],
        "engine_idle_s_after_run": idle_after,
        "leaked_pages": m["jaxllm_kv_cache_pages"] - m["jaxllm_kv_cache_free_pages"],
        "rss_after_warmup_mb": round(rss_warm / 2**20, 1), "rss_after_run_mb": round(
            m["process_resident_memory_bytes"] / 2**20, 1),
        "rss_growth_mb": round((m["process_resident_memory_bytes"] - rss_warm) / 2**20, 1),
        "health_polls": len(health), "health_errors": len(health_errors),
        "health_p50_ms": round(statistics.median(health) * 1e3, 1),
        "health_p99_ms": round(health_sorted[min(len(health) - 1, int(0.99 * len(health)))] * 1e3, 1),
        "latency_median_s": round(statistics.median(o.seconds for o in outcomes if o.kind == "ok"), 2),
        "generation_tokens": m["jaxllm_generation_tokens_total"] - warm["jaxllm_generation_tokens_total"],
    }


def wait_idle(base: str, timeout: float) -> float | None:
    """Seconds until no request runs or waits and every page is free; None if that never happens."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        m = metrics(base)
        if m["jaxllm_num_requests_running"] == 0 and m["jaxllm_num_requests_waiting"] == 0 and \
                m["jaxllm_kv_cache_free_pages"] == m["jaxllm_kv_cache_pages"]:
            return round(time.monotonic() - start, 2)
        time.sleep(0.05)
    return None


def check(result: dict) -> list[str]:
    """The acceptance criteria; an empty list when all hold."""
    problems = []
    if result["failed"]:
        problems.append(f"{result['failed']} failed requests: {result['failures'][:3]}")
    if result["stuck_requests"] or result["engine_idle_s_after_run"] is None:
        problems.append("requests still running or waiting after the run")
    if result["leaked_pages"]:
        problems.append(f"{result['leaked_pages']:.0f} KV pages not freed")
    if result["rss_growth_mb"] > 100:
        problems.append(f"RSS grew {result['rss_growth_mb']} MB")
    if result["health_p99_ms"] >= 100 or result["health_errors"]:
        problems.append(f"/health p99 {result['health_p99_ms']} ms, {result['health_errors']} errors")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect", type=float, default=0.3, help="fraction of clients that walk away")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    result = soak(args.base_url.rstrip("/"), args.api_key, args.requests, args.concurrency, args.disconnect,
                  args.seed)
    problems = check(result)
    result["problems"] = problems
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
