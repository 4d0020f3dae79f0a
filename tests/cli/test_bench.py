"""``jaxllm bench serve`` against a running jaxllm server (gunicorn on the tiny Llama, an API key required): every
request completes with exactly the asked tokens (--ignore-eos), prompts have the asked token counts,
the saved file carries vLLM's metric names, --max-concurrency holds, the chat backend works, and a server that
refuses the key is one line with exit status 2."""

import json
import os
import subprocess
import sys

import pytest
import requests

from tests.server.conftest import API_KEY, ROOT

pytestmark = pytest.mark.slow


def bench(server, tiny_folder, *flags, key=API_KEY):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXLLM_")} | {"OPENAI_API_KEY": key}
    return subprocess.run([sys.executable, "-m", "jaxllm", "bench", "serve", "--base-url", server.url,
                           "--tokenizer", str(tiny_folder), "--disable-tqdm", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_bench_serve_completions(server, tiny_folder, tmp_path):
    run = bench(server, tiny_folder, "--dataset-name", "random", "--random-input-len", "24", "--random-output-len",
                "8", "--num-prompts", "6", "--request-rate", "20", "--ignore-eos", "--save-result", "--result-dir",
                str(tmp_path), "--result-filename", "r.json", "--metric-percentiles", "50,99",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metadata", "machine=ci")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Serving Benchmark Result" in run.stdout and "P50 TTFT (ms):" in run.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["output_lens"] == [8] * 6 and result["total_output_tokens"] == 48
    assert result["machine"] == "ci" and result["backend"] == "openai" and result["request_rate"] == 20
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{name}_ms" in result
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert result["output_throughput"] == pytest.approx(48 / result["duration"])
    model = requests.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert result["model_id"] == model["data"][0]["id"]  # the server's first model, as nothing named one
    assert all(22 <= n <= 26 for n in result["input_lens"]) and result["total_input_tokens"] == sum(
        result["input_lens"])


def test_bench_serve_chat_with_a_concurrency_cap(server, tiny_folder, tmp_path):
    run = bench(server, tiny_folder, "--backend", "openai-chat", "--random-input-len", "16", "--random-output-len",
                "6", "--num-prompts", "5", "--max-concurrency", "2", "--ignore-eos", "--save-result", "--result-dir",
                str(tmp_path), "--seed", "5")
    assert run.returncode == 0, run.stderr[-2000:]
    [saved] = list(tmp_path.glob("openai-chat-infqps-concurrency2-*.json"))
    result = json.loads(saved.read_text())
    assert result["completed"] == 5 and result["output_lens"] == [6] * 5
    assert result["max_concurrent_requests"] <= 2 and result["max_concurrency"] == 2
    assert "Maximum request concurrency:             2" in run.stdout


def test_bench_serve_errors_are_one_line(server, tiny_folder):
    refused = bench(server, tiny_folder, "--num-prompts", "2", key="wrong")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: {server.url} refused the key (HTTP 401; set OPENAI_API_KEY)"]
    no_tokenizer = bench(server, tiny_folder, "--num-prompts", "2", "--tokenizer", "/nonexistent/model")
    assert no_tokenizer.returncode == 2 and len(no_tokenizer.stderr.strip().splitlines()) == 1
    assert "no tokenizer for '/nonexistent/model'" in no_tokenizer.stderr and "pass --tokenizer" in no_tokenizer.stderr
    bad = bench(server, tiny_folder, "--request-rate", "0")
    assert bad.returncode == 2 and "--request-rate: must be positive" in bad.stderr
