"""Offline throughput on the shared peer workload (benchmarks/peer_workload.json, a copy of
../shared/peers/workload.json): 32 prompts of 128 tokens, 128 new tokens each, greedy, EOS ignored (generated
tok/s over the whole run, prefill included); and a single stream (prompt 0, 128 new tokens: decode tok/s after the
first token). Peers measured side by side in the same run: llama.cpp's own tools (built by
../shared/peers/build_llamacpp.sh) on the F16, F32 and Q4_1 GGUFs of the same model, `llama-batched-bench -npp 128
-ntg 128 -npl 32` and `llama-bench -n 128`, 2 threads; and HF transformers (float32, padded batch generate) when
torch is installed. Engines alternate within each round, each in its own process; figures are medians over rounds.

jaxllm runs with its defaults (the `smollm2-cpu` preset the server uses: the embedded GGUF served as its own
Q4_1/Q8_0 weights) unless --quantization says otherwise; --int8-paths adds runs on other integer matmul paths (e.g.
amx, which the engine takes only when asked), alternating with the rest.

    python benchmarks/offline.py [--rounds 3] [--quantization none] [--int8-paths amx] [--no-peers] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine
import peers
import workload

from pallas_kernels.quantized_matmul import isa

LLAMA_TYPES = ("F16", "F32", "Q4_1")


def run_jaxllm(quantization: str | None) -> dict:
    from jaxllm import LLM

    options = {} if quantization is None else {"quantization": quantization}
    return workload.run(LLM(preset="smollm2-cpu", **options))


def run_transformers(work: dict) -> dict | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from jaxllm.loading.embedded import embedded_model_path

    path = embedded_model_path()
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    gen = work["gen_len"]
    prompts = torch.tensor([work["prompts"][i] for i in work["batch_prompt_indices"]])  # all 128 long
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=gen,
                       min_new_tokens=gen)
        batch = len(prompts) * gen / (time.perf_counter() - start)
        single = torch.tensor([work["prompts"][work["single_stream_prompt_index"]]])
        start = time.perf_counter()
        model.generate(single, attention_mask=torch.ones_like(single), do_sample=False, max_new_tokens=1)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(single, attention_mask=torch.ones_like(single), do_sample=False, max_new_tokens=gen,
                       min_new_tokens=gen)
        single_tps = (gen - 1) / (time.perf_counter() - start - ttft)
    return {"batch_tok_s": batch, "single_tok_s": single_tps, "ttft_s": ttft}


def run_isolated(name: str, quantization: str | None, int8_path: str | None = None) -> dict | None:
    """Each engine in its own process: their thread pools (XLA, numba's, torch's OpenMP) must not share the two
    cores or each other's settings (torch ran 6x slower after jaxllm in one process). int8_path: jaxllm's
    integer matmul path (`JAXLLM_CPU_INT8_ISA`), else the engine's choice."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--engine", name, "--json", str(out)]
        if quantization:
            cmd += ["--quantization", quantization]
        env = {**os.environ, isa.ENV: int8_path} if int8_path else None
        subprocess.run(cmd, check=True, env=env)
        return json.loads(out.read_text())


def run_llama(peer: Path, kind: str) -> dict:
    model = peers.gguf(peer, kind)
    return {"batch_tok_s": peers.batched(peer, model), "single_tok_s": peers.single_stream(peer, model)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantization", help="jaxllm's weights (default: the engine's default, the GGUF's own)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--int8-paths", default="", help="also run jaxllm on these integer matmul paths (comma-separated, "
                   "e.g. amx), each in every round")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--engine", choices=("jaxllm", "transformers"), help=argparse.SUPPRESS)  # one run, here
    args = p.parse_args()
    if args.engine:
        result = run_jaxllm(args.quantization) if args.engine == "jaxllm" else run_transformers(workload.load())
        Path(args.json).write_text(json.dumps(result))
        return
    peer = None if args.no_peers else peers.peer_dir()
    label = f"jaxllm ({args.quantization or 'defaults'})"
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        runs.setdefault(label, []).append(run_isolated("jaxllm", args.quantization))
        print(f"round {r}: {label} {runs[label][-1]}", flush=True)
        for path in filter(None, args.int8_paths.split(",")):
            key = f"jaxllm (int8 path {path})"
            runs.setdefault(key, []).append(run_isolated("jaxllm", args.quantization, path))
            print(f"round {r}: {key} {runs[key][-1]}", flush=True)
        if peer is not None:
            for kind in LLAMA_TYPES:
                key = f"llama.cpp {kind}"
                runs.setdefault(key, []).append(run_llama(peer, kind))
                print(f"round {r}: {key} {runs[key][-1]}", flush=True)
        if not args.no_peers:
            t = run_isolated("transformers", None)
            if t is not None:
                runs.setdefault("transformers f32", []).append(t)
                print(f"round {r}: transformers {t}", flush=True)
    summary = {k: {m: statistics.median(x[m] for x in rs) for m in ("batch_tok_s", "single_tok_s")}
               for k, rs in runs.items()}
    host = machine.describe()
    print(f"\nmedians over {args.rounds} rounds; jaxllm weights: {runs[label][0]['weights']}\n{machine.line(host)}")
    print(f"{'engine':22s} {'batch 32 tok/s':>15s} {'single tok/s':>13s}")
    for k, m in summary.items():
        print(f"{k:22s} {m['batch_tok_s']:15.1f} {m['single_tok_s']:13.1f}")
    ours = summary[label]
    ratios = {}
    for key in (k for k in summary if k.startswith("jaxllm (int8 path")):
        ratios[f"{key} / defaults, batch"] = summary[key]["batch_tok_s"] / ours["batch_tok_s"]
        ratios[f"{key} / defaults, single"] = summary[key]["single_tok_s"] / ours["single_tok_s"]
    if peer is not None:
        best = max(("llama.cpp F16", "llama.cpp F32"), key=lambda k: summary[k]["batch_tok_s"])
        ratios = {f"batch vs {best}": ours["batch_tok_s"] / summary[best]["batch_tok_s"],
                  "single vs llama.cpp F32": ours["single_tok_s"] / summary["llama.cpp F32"]["single_tok_s"],
                  "batch vs llama.cpp Q4_1": ours["batch_tok_s"] / summary["llama.cpp Q4_1"]["batch_tok_s"],
                  "single vs llama.cpp Q4_1": ours["single_tok_s"] / summary["llama.cpp Q4_1"]["single_tok_s"]}
    if "transformers f32" in summary:
        ratios["batch vs transformers"] = ours["batch_tok_s"] / summary["transformers f32"]["batch_tok_s"]
    for k, v in ratios.items():
        print(f"jaxllm {k}: {v:.2f}x")
    for cmd in dict.fromkeys(peers.repack_off):
        print(f"ran again with llama.cpp's repack off: {cmd}")
    machine.save(args.json, host, rounds=args.rounds, summary=summary, ratios=ratios, runs=runs,
                 llama_repack_off=sorted(set(peers.repack_off)))


if __name__ == "__main__":
    main()
