"""``jaxllm bench serve``: the serving benchmark (`jaxllm.bench.serve`) with ``vllm bench serve``'s flags, against
any OpenAI-compatible server (jaxllm, vLLM, llama-server).

    jaxllm bench serve --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 128 \\
        --random-output-len 128 --num-prompts 64 --request-rate 2 --ignore-eos --save-result

The model defaults to the server's first (``GET /v1/models``) and the tokenizer to the model (a folder, a GGUF
file or a hub id; jaxllm's embedded model by its served name). Prompt lengths are counted with that tokenizer, and
output tokens from the server's streamed ``usage``. An unreachable server, a model with no tokenizer or a bad
value is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (inf: all at once), got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def add_parsers(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: `jaxllm bench serve` (a running server's latency and "
                                         "throughput)")
    kinds = bench.add_subparsers(dest="bench", metavar="{serve}", required=True, parser_class=type(bench))
    p = kinds.add_parser("serve", help="send requests to a running server, as `vllm bench serve`",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("server")
    where.add_argument("--backend", default="openai", choices=["openai", "openai-chat", "vllm"],
                       help="openai (and vllm): /v1/completions; openai-chat: /v1/chat/completions")
    where.add_argument("--base-url", help="the server's root URL (default: http://HOST:PORT)")
    where.add_argument("--host", default="127.0.0.1")
    where.add_argument("--port", type=int, default=8000)
    where.add_argument("--endpoint", help="default: the backend's")
    where.add_argument("--model", help="default: the server's first model")
    where.add_argument("--tokenizer", help="counts prompt tokens (default: the model)")
    where.add_argument("--ready-check-timeout-sec", type=float, default=600,
                       help="wait this long for the server to answer /v1/models (0: do not wait)")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=["random", "custom"])
    data.add_argument("--dataset-path", help="custom: a JSONL file of {\"prompt\": ...} lines")
    data.add_argument("--num-prompts", type=_positive, default=1000)
    data.add_argument("--random-input-len", type=_positive, default=1024)
    data.add_argument("--random-output-len", type=_positive, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0)
    data.add_argument("--custom-output-len", type=_positive, default=256)
    load = p.add_argument_group("load and sampling")
    load.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests/s (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    load.add_argument("--max-concurrency", type=_positive)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--ignore-eos", action="store_true", help="every request generates its full output length")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--top-p", type=float)
    load.add_argument("--top-k", type=int)
    report = p.add_argument_group("results")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft, tpot, itl, e2el")
    report.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    report.add_argument("--save-result", action="store_true")
    report.add_argument("--result-dir", default=".")
    report.add_argument("--result-filename")
    report.add_argument("--label", help="names the run in the saved file (default: the backend)")
    report.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="saved with the result")
    report.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(run=run_serve)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _wait_ready(base_url: str, api_key: str | None, timeout: float) -> list[str]:
    """The server's model ids, once /v1/models answers (an error if it has not within `timeout` s)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = requests.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
            if r.status_code == 200:
                return [m["id"] for m in r.json().get("data", [])]
            if r.status_code in (401, 403):
                raise RuntimeError(f"{base_url} refused the key (HTTP {r.status_code}; set OPENAI_API_KEY)")
            problem = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            problem = type(e).__name__
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{base_url} is not ready ({problem})")
        time.sleep(1)


def _tokenizer(name: str):
    from jaxllm.loading import LoadError, load_tokenizer
    from jaxllm.loading.embedded import EMBEDDED_NAME

    try:
        tok = load_tokenizer(None if name == EMBEDDED_NAME else name)
    except LoadError as e:
        raise RuntimeError(f"no tokenizer for {name!r} ({e}); pass --tokenizer") from None
    if tok is None:
        raise RuntimeError(f"{name!r} has no tokenizer files; pass --tokenizer")
    return tok


def run_serve(args: argparse.Namespace) -> int:
    from jaxllm.bench import datasets, serve

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    backend = "openai" if args.backend == "vllm" else args.backend
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := set(metrics) - set(serve.METRICS):
        return _fail(f"--percentile-metrics: unknown {sorted(unknown)} (of {', '.join(serve.METRICS)})")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
        if not all(0 < p < 100 for p in percentiles):
            raise ValueError
    except ValueError:
        return _fail(f"--metric-percentiles: numbers in (0, 100) expected, got {args.metric_percentiles!r}")
    if args.dataset_name == "custom" and not args.dataset_path:
        return _fail("--dataset-name custom needs --dataset-path")
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            return _fail(f"--metadata: KEY=VALUE expected, got {item!r}")
        metadata[key] = value
    api_key = os.environ.get("OPENAI_API_KEY")
    try:
        models = _wait_ready(base_url, api_key, args.ready_check_timeout_sec)
        model = args.model or (models[0] if models else None)
        if model is None:
            return _fail(f"{base_url} lists no models; pass --model")
        tokenizer = _tokenizer(args.tokenizer or model)
        if args.dataset_name == "random":
            reqs = datasets.random_requests(tokenizer, args.num_prompts, input_len=args.random_input_len,
                                            output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                                            prefix_len=args.random_prefix_len, seed=args.seed)
        else:
            reqs = datasets.custom_requests(args.dataset_path, tokenizer, args.num_prompts,
                                            output_len=args.custom_output_len)
        sampling = {"temperature": args.temperature}
        sampling |= {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k)) if v is not None}
        target = serve.Target(base_url, args.endpoint or serve.ENDPOINTS[backend], model, backend, api_key,
                              args.ignore_eos, sampling)
    except (RuntimeError, ValueError, OSError) as e:
        return _fail(str(e))
    result = serve.run(target, reqs, request_rate=args.request_rate, burstiness=args.burstiness,
                       max_concurrency=args.max_concurrency, seed=args.seed, tokenizer=tokenizer,
                       progress=not args.disable_tqdm, percentiles=percentiles)
    print(serve.format_result(result, metrics, percentiles))
    if result["completed"] == 0:
        errors = [e for e in result["errors"] if e]
        return _fail(f"every request failed (first: {errors[0] if errors else 'unknown'})")
    if args.save_result:
        result |= {"backend": args.backend, "label": args.label or args.backend, "model_id": model,
                   "tokenizer_id": args.tokenizer or model, "base_url": base_url, **metadata}
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = args.result_filename or \
            f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{Path(model).name}-{result['date']}.json"
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
        print(f"saved {path}")
    return 0
