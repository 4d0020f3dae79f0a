"""Start-up of the CLI and the server, cold and warm, each in a fresh process.

    python benchmarks/startup.py [--rounds 3] [--out benchmarks/results/startup.json]

- cli: wall time of ``python -m jaxllm.generate "What is the capital of France?"`` until it exits with the answer
  (Python and JAX start included), and the figures it reports (load, compile, time to first token).
- server: ``gunicorn server.app:app`` (default preset) from spawn until ``/health`` answers 200, then one chat
  request to check it answers; its start-up log line gives the breakdown.

cold: empty JAX compilation cache, executable cache and numba cache (each round gets fresh ones); warm: the same
command again on the caches the cold run just filled. Rounds alternate cold and warm; the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "What is the capital of France?"


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["NUMBA_CACHE_DIR"] = str(cache / "numba")  # numba's cache normally sits beside the installed sources
    env["JAXLLM_COMPILATION_CACHE_DIR"] = str(cache / "xla")
    env.pop("XLA_FLAGS", None)
    return env


def run_cli(cache: Path) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jaxllm.generate", "--compilation-cache-dir", str(cache / "xla"),
                          PROMPT], capture_output=True, text=True, env=_env(cache), cwd=ROOT, timeout=600)
    wall = time.perf_counter() - start
    if out.returncode != 0 or "Paris" not in out.stdout:
        raise RuntimeError(f"CLI failed or answered wrongly: {out.stdout!r}\n{out.stderr[-2000:]}")
    m = re.search(r"load ([\d.]+) s .*compile ([\d.]+) s .*time to first token ([\d.]+) s, decode ([\d.]+|n/a)",
                  out.stderr)
    return {"wall_s": wall, "load_s": float(m[1]), "compile_s": float(m[2]), "ttft_s": float(m[3]),
            "decode_tok_s": None if m[4] == "n/a" else float(m[4])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 1.0, body: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


def run_server(cache: Path) -> dict:
    port = _free_port()
    env = _env(cache) | {"JAXLLM_BIND": f"127.0.0.1:{port}"}
    log = tempfile.TemporaryFile(mode="w+")
    start = time.perf_counter()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("gunicorn")), "server.app:app"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while _get(f"http://127.0.0.1:{port}/health", 0.5)[0] != 200:
            if proc.poll() is not None or time.perf_counter() - start > 600:
                log.seek(0)
                raise RuntimeError(f"server did not start:\n{log.read()[-3000:]}")
            time.sleep(0.05)
        ready = time.perf_counter() - start
        status, body = _get(f"http://127.0.0.1:{port}/v1/chat/completions", 60, {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32, "temperature": 0})
        answer = json.loads(body)["choices"][0]["message"]["content"] if status == 200 else ""
        if "Paris" not in answer:
            raise RuntimeError(f"server answered {status} {answer!r}")
        first_answer = time.perf_counter() - start - ready
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    log.seek(0)
    m = re.search(r"start-up: ([\d.]+) s: load ([\d.]+) s, KV cache ([\d.]+) s, \d+ buckets ([\d.]+) s", log.read())
    return {"ready_s": ready, "first_answer_s": first_answer, "engine_s": float(m[1]), "load_s": float(m[2]),
            "kv_cache_s": float(m[3]), "buckets_s": float(m[4])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--what", default="cli,server")
    p.add_argument("--out", help="write the runs and medians as JSON")
    args = p.parse_args()
    runners = {"cli": run_cli, "server": run_server}
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for what in args.what.split(","):
            with tempfile.TemporaryDirectory(prefix="jaxllm-startup-") as tmp:
                for mode in ("cold", "warm"):
                    result = runners[what](Path(tmp))
                    runs.setdefault(f"{what} {mode}", []).append(result)
                    print(f"round {r + 1} {what} {mode}: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in result.items() if v is not None), flush=True)
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0] if rs[0][k] is not None}
               for name, rs in runs.items()}
    print(f"\nmedians of {args.rounds} rounds (seconds; fresh processes)")
    print("| run | wall / ready | load | compile / buckets | time to first token / first answer |")
    print("|---|---|---|---|---|")
    for name, m in medians.items():
        if name.startswith("cli"):
            print(f"| `python -m jaxllm.generate` {name.split()[1]} | {m['wall_s']:.1f} | {m['load_s']:.2f} | "
                  f"{m['compile_s']:.2f} | {m['ttft_s']:.2f} |")
        else:
            print(f"| `gunicorn server.app:app` {name.split()[1]} | {m['ready_s']:.1f} | {m['load_s']:.2f} | "
                  f"{m['buckets_s']:.2f} | {m['first_answer_s']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": args.rounds, "runs": runs, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
