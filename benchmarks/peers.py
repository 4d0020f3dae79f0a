"""llama.cpp's tools as same-run peers: built once per machine by ../shared/peers/build_llamacpp.sh (which also
makes F32/F16/Q8_0 GGUFs of the embedded model beside the shipped Q4_1), run with 2 threads like the engine.
Every figure here is measured in the calling benchmark's run, on its machine, next to jaxllm's."""

from __future__ import annotations

import contextlib
import csv
import io
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

BUILD = Path(__file__).resolve().parents[2] / "shared" / "peers" / "build_llamacpp.sh"
TYPES = ("F32", "F16", "Q8_0", "Q4_1")


def peer_dir() -> Path | None:
    """The built tools' folder (bin/, gguf/), building them if this machine has not yet (~25 min); None when
    the build script is absent (a checkout outside this workspace)."""
    if not BUILD.exists():
        return None
    out = subprocess.run(["bash", str(BUILD)], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def gguf(peers: Path, kind: str) -> str:
    return str(peers / "gguf" / f"SmolLM2-135M-Instruct.{kind}.gguf")


def single_stream(peers: Path, model: str, tokens: int = 128) -> float:
    """Decode tok/s of one stream (`llama-bench -p 0 -n tokens`, mean over 3 repetitions)."""
    out = subprocess.run([str(peers / "bin" / "llama-bench"), "-m", model, "-t", "2", "-p", "0", "-n", str(tokens),
                          "-r", "3", "-o", "csv"], check=True, capture_output=True, text=True).stdout
    return float(next(csv.DictReader(io.StringIO(out)))["avg_ts"])


def batched(peers: Path, model: str, prompt: int = 128, gen: int = 128, streams: int = 32) -> float:
    """Generated tok/s of `streams` sequences of prompt + gen tokens over the whole run, prefill included
    (`llama-batched-bench`: streams x gen / total time). Where llama.cpp's default run crashes (its AMX
    repacked Q4_1 weights died with SIGSEGV in this benchmark on a Xeon with AMX), it runs again with
    `--no-repack` and says so on stderr: `batched_modes` records which ran."""
    cmd = [str(peers / "bin" / "llama-batched-bench"), "-m", model, "-t", "2", "-tb", "2",
           "-c", str(streams * (prompt + gen) + 64), "-b", "2048", "-ub", "512", "-npp", str(prompt),
           "-ntg", str(gen), "-npl", str(streams)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    mode = "default"
    if run.returncode != 0:
        print(f"llama-batched-bench on {Path(model).name} exited with {run.returncode}; again with --no-repack",
              file=sys.stderr)
        run = subprocess.run([*cmd, "--no-repack"], check=True, capture_output=True, text=True)
        mode = "--no-repack (the default run crashed)"
    batched_modes[Path(model).name] = mode
    row = [r for r in run.stdout.splitlines() if re.match(rf"\|\s+{prompt} \|\s+{gen} \|\s+{streams} \|", r)][0]
    total_s = float(row.strip("|").split("|")[8])
    return streams * gen / total_s


batched_modes: dict[str, str] = {}  # GGUF file name -> how `batched` last ran llama.cpp on it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(cmd: list[str], port: int, *, timeout: float = 120, **popen) -> Iterator[str]:
    """Starts an HTTP server (`cmd`, listening on 127.0.0.1:`port`), waits until its /health answers 200 and
    yields its base URL; stops it on exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd[0]} did not become healthy in {timeout} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def server(peers: Path, model: str, slots: int = 16, ctx: int = 5120, port: int | None = None):
    """`llama-server` with `slots` parallel slots and continuous batching (a context manager yielding its URL)."""
    port = port or free_port()
    return running([str(peers / "bin" / "llama-server"), "-m", model, "-t", "2", "-np", str(slots), "-c", str(ctx),
                    "--host", "127.0.0.1", "--port", str(port)], port)
