"""Quantized weights against llama.cpp on the same GGUF files, side by side in one run (the peer workload:
benchmarks/peer_workload.json). For each file (the embedded Q4_1 and the Q8_0 that ../shared/peers/build_llamacpp.sh
makes from it):

- single stream: prompt 0, 128 new tokens, greedy, EOS ignored; decode tok/s after the first token (jaxllm) vs
  ``llama-bench -t 2 -p 0 -n 128`` (avg_ts);
- batched: the 32 prompts of 128 tokens, 128 new tokens each, generated tok/s including prefill (jaxllm's
  offline LLM.generate) vs ``llama-batched-bench -npp 128 -ntg 128 -npl 32`` (32 x 128 / T);
- resident weights: jaxllm's parameter bytes against the file's tensor bytes (RSS over a load:
  tests/loading/test_quantized_memory.py).

jaxllm runs with the `smollm2-cpu` preset (so a float16 KV cache, as llama.cpp's) and also runs the Q4_1 file
dequantized to float32 (quantization="none"), the previous default. Engines
alternate within each round, each jaxllm configuration in its own process; figures are medians over rounds.

    python benchmarks/quantized.py [--rounds 3] [--json benchmarks/results/quantized_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import machine
import peers
import workload


def run_jaxllm(model: str, quantization: str) -> dict:
    """One configuration, in this process."""
    from jaxllm import LLM
    from jaxllm.loading import weight_bytes
    from jaxllm.loading.gguf_file import GGUFFile

    llm = LLM(model, preset="smollm2-cpu", quantization=quantization, num_pages=640, max_model_len=1024)
    result = workload.run(llm, single_runs=2)
    del result["ttft_s"]
    tensor_bytes = sum(t.nbytes for t in GGUFFile(model).tensors.values())
    return {**result, "weight_bytes": weight_bytes(llm.engine.model), "file_tensor_bytes": tensor_bytes}


def jaxllm_isolated(model: str, quantization: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        subprocess.run([sys.executable, __file__, "--one", model, quantization, str(out)], check=True)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # model quantization out.json: one run, here
    args = p.parse_args()
    if args.one:
        model, quantization, out = args.one
        Path(out).write_text(json.dumps(run_jaxllm(model, quantization)))
        return
    peer = peers.peer_dir()
    if peer is None:
        raise SystemExit(f"no llama.cpp peers: {peers.BUILD} is missing")
    files = {t: peers.gguf(peer, t) for t in ("Q4_1", "Q8_0")}
    configs = [("Q4_1", "auto"), ("Q8_0", "auto"), ("Q4_1", "none")]
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for name, quantization in configs:
            key = f"jaxllm {name} {'as ' + name if quantization == 'auto' else 'as float32'}"
            runs.setdefault(key, []).append(jaxllm_isolated(files[name], quantization))
            print(key, runs[key][-1], flush=True)
            if quantization == "auto":
                key = f"llama.cpp {name}"
                runs.setdefault(key, []).append({"single_tok_s": peers.single_stream(peer, files[name]),
                                                 "batch_tok_s": peers.batched(peer, files[name])})
                print(key, runs[key][-1], flush=True)
    summary = {}
    for key, rs in runs.items():
        summary[key] = {k: statistics.median(r[k] for r in rs) for k in ("single_tok_s", "batch_tok_s")}
        if "weight_bytes" in rs[0]:
            summary[key].update(weight_bytes=rs[0]["weight_bytes"], file_tensor_bytes=rs[0]["file_tensor_bytes"])
    host = machine.describe()
    print(machine.line(host))
    print(f"{'engine':28s} {'single tok/s':>13s} {'batch 32 tok/s':>15s} {'weights MB':>11s}")
    for key, s in summary.items():
        mb = f"{s['weight_bytes'] / 1e6:11.1f}" if "weight_bytes" in s else f"{'':11s}"
        print(f"{key:28s} {s['single_tok_s']:13.1f} {s['batch_tok_s']:15.1f} {mb}")
    for name in files:
        ours, peer = summary[f"jaxllm {name} as {name}"], summary[f"llama.cpp {name}"]
        print(f"{name}: jaxllm / llama.cpp single {ours['single_tok_s'] / peer['single_tok_s']:.2f}x, batched "
              f"{ours['batch_tok_s'] / peer['batch_tok_s']:.2f}x; weights / file tensors "
              f"{ours['weight_bytes'] / ours['file_tensor_bytes']:.3f}")
    machine.save(args.json, host, rounds=args.rounds, summary=summary, runs=runs,
                 llama_repack_off=sorted(set(peers.repack_off)))


if __name__ == "__main__":
    main()
