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


repack_off: list[str] = []  # the commands `run_tool` ran again with llama.cpp's weight repack off
BENCH_NO_REPACK = ["--repack", "0"]  # llama-bench's flag
BATCHED_NO_REPACK = ["--no-repack"]  # llama-batched-bench's, llama-perplexity's (llama.cpp's common flags)


def run_tool(cmd: list[str], no_repack: list[str], with_stderr: bool = False) -> str:
    """A llama.cpp tool's stdout (and its stderr after it: with_stderr). Where its default run crashes (on a Xeon
    with AMX, llama.cpp's AMX-repacked Q4_1/Q8_0 weights died with SIGSEGV in `llama-batched-bench` and in
    `llama-bench`'s prompt runs; its decode runs did not), it runs again with the repack off (`no_repack`: the
    tool's flag for it), says so on stderr, and `repack_off` records the command."""
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(f"{Path(cmd[0]).name} exited with {run.returncode}; again with {' '.join(no_repack)}", file=sys.stderr)
        repack_off.append(" ".join([Path(cmd[0]).name, *cmd[1:], *no_repack]))
        run = subprocess.run([*cmd, *no_repack], check=True, capture_output=True, text=True)
    return run.stdout + (run.stderr if with_stderr else "")


def single_stream(peers: Path, model: str, tokens: int = 128) -> float:
    """Decode tok/s of one stream (`llama-bench -p 0 -n tokens`, mean over 3 repetitions)."""
    out = run_tool([str(peers / "bin" / "llama-bench"), "-m", model, "-t", "2", "-p", "0", "-n", str(tokens), "-r",
                    "3", "-o", "csv"], BENCH_NO_REPACK)
    return float(next(csv.DictReader(io.StringIO(out)))["avg_ts"])


def batched(peers: Path, model: str, prompt: int = 128, gen: int = 128, streams: int = 32) -> float:
    """Generated tok/s of `streams` sequences of prompt + gen tokens over the whole run, prefill included
    (`llama-batched-bench`: streams x gen / total time)."""
    out = run_tool([str(peers / "bin" / "llama-batched-bench"), "-m", model, "-t", "2", "-tb", "2",
                    "-c", str(streams * (prompt + gen) + 64), "-b", "2048", "-ub", "512", "-npp", str(prompt),
                    "-ntg", str(gen), "-npl", str(streams)], BATCHED_NO_REPACK)
    row = [r for r in out.splitlines() if re.match(rf"\|\s+{prompt} \|\s+{gen} \|\s+{streams} \|", r)][0]
    total_s = float(row.strip("|").split("|")[8])
    return streams * gen / total_s


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
