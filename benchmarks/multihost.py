"""What multi-host lockstep costs per step: the same engine (a tiny random Qwen2, 8 heads / 4 KV heads, tensor
parallel 4, 16 sequences decoding) as one process with 4 host devices, and as two processes with 2 each
(rank 0 sends every step's inputs to rank 1 over the step channel; the collectives cross processes through
gloo). Reports the median decode step (rank 0's `engine.step()`, wall), the step channel's send time and bytes
per step, alternating the two layouts over rounds, same machine, same run.

    python benchmarks/multihost.py [--rounds 3] [--steps 64] [--json benchmarks/results/multihost_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RANK0 = """
import json, statistics, sys, time
from jaxllm import SamplingParams
from jaxllm.engine.llm_engine import LLMEngine
from server.settings import ServerSettings

steps = int(sys.argv[1])
engine = LLMEngine(ServerSettings.from_env().engine)
params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
for i in range(16):
    engine.add_request(f"r{i}", [(7 * i + j) % 1000 for j in range(24)], params)
walls = []
while engine.has_unfinished_requests():
    start = time.perf_counter()
    engine.step()
    walls.append(time.perf_counter() - start)
decode = walls[4:4 + steps]  # after the prompts' step
ch = engine.step_channel_stats
print(json.dumps({"step_ms": 1e3 * statistics.median(decode), "steps": len(walls),
                  "send_us": 1e6 * ch["send_s"] / ch["steps"] if ch else 0.0,
                  "bytes_per_step": ch["bytes"] / ch["steps"] if ch else 0}))
engine.close()
"""


def run(env: dict[str, str], steps: int, follower: bool) -> dict:
    proc = None
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    if follower:
        proc = subprocess.Popen([sys.executable, "-m", "server.engine_core", "--headless", "--host-rank", "1"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        out = subprocess.run([sys.executable, "-c", RANK0, str(steps)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if proc is not None:
            proc.wait(60)
            log.seek(0)
            result["follower_decode_us"] = float(re.search(r"median (\d+) us decoding a step's message",
                                                             log.read()).group(1))
        return result
    finally:
        if proc is not None:
            proc.kill()
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()
    from tests.engine.test_multihost import coordinator_port, engine_env, multihost_env
    from tests.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as d:
        folder, _ = build_tiny_hf_model("qwen2_tp", Path(d) / "qwen2_tp")
        cache = str(Path(d) / "xla")
        budget = {"JAXLLM_MAX_NUM_BATCHED_TOKENS": "64"}
        one = engine_env(folder, cache, JAXLLM_TENSOR_PARALLEL_SIZE="4", JAXLLM_PRESET="smollm2-cpu",
                         XLA_FLAGS="--xla_force_host_platform_device_count=4", **budget)
        results: dict[str, list[dict]] = {"1 process x 4 devices": [], "2 processes x 2 devices": []}
        for r in range(args.rounds + 1):  # round 0 fills the compilation cache
            a = run(one, args.steps, follower=False)
            b = run(multihost_env(folder, cache, coordinator_port(), **budget), args.steps, follower=True)
            if r:
                results["1 process x 4 devices"].append(a)
                results["2 processes x 2 devices"].append(b)
                print(f"round {r}: one process {a['step_ms']:.2f} ms/step, two processes {b['step_ms']:.2f} ms/step "
                      f"(send {b['send_us']:.0f} us, {b['bytes_per_step']:.0f} B; follower decode "
                      f"{b['follower_decode_us']:.0f} us)", flush=True)
    metrics = ("step_ms", "send_us", "bytes_per_step", "follower_decode_us")
    summary = {k: {m: statistics.median(x.get(m, 0.0) for x in v) for m in metrics} for k, v in results.items()}
    one_ms, two = summary["1 process x 4 devices"]["step_ms"], summary["2 processes x 2 devices"]
    print(f"median decode step: one process {one_ms:.2f} ms, two processes {two['step_ms']:.2f} ms "
          f"(+{two['step_ms'] - one_ms:.2f} ms, {two['step_ms'] / one_ms:.2f}x); step channel send "
          f"{two['send_us']:.0f} us/step, {two['bytes_per_step']:.0f} B/step; follower decode "
          f"{two['follower_decode_us']:.0f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "steps": args.steps, "summary": summary,
                                               "runs": results, "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
