"""Where a decode step's time goes: the engine (the `smollm2-cpu` preset, or it with the given quantization and
KV cache dtype) decodes a batch of the peer workload's prompts under JAX's profiler, and each step's wall time is
split into

- attention: the paged-attention op (custom call or XLA ops named by the kernel);
- layer matmuls: matmul custom calls and dots inside the decoder's layer loop;
- other layer ops: everything else inside the layer loop (norms, RoPE, residuals, the loop itself);
- LM head: the matmul after the loop;
- sampling and the rest: device ops outside the loop that are not the head (embedding lookup, sampler);
- host: the step's wall time outside the executable's run (scheduling, input building, dispatch, reading the
  result, detokenizing).

Ops are told apart by the step executable's optimized HLO (custom-call targets, dot opcodes) and by how often
they ran in one step (once a layer: the layer loop's body; once: outside it). The profiler adds a little time to
every op: compare breakdowns, not totals against other benchmarks.

    python benchmarks/step_breakdown.py [--batch 1,32] [--steps 16] [--quantization auto] [--kv-cache-dtype float32]
        [--model path.gguf] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import machine
import workload

PARTS = ("attention", "layer matmuls", "other layer ops", "LM head", "sampling and rest", "host")


def op_kinds(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> "attention" | "matmul" | "other", from an optimized module's text."""
    kinds = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?\b(custom-call|dot|fusion)\(([^\n]*)$", hlo_text,
                         re.MULTILINE):
        name, op, rest = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        if op == "custom-call" and target:
            t = target.group(1)
            kinds[name] = "attention" if "attention" in t else "matmul" if "matmul" in t else "other"
        elif op == "dot" or (op == "fusion" and re.search(r"calls=%?[\w.\-]*dot", rest)):
            kinds[name] = "matmul"
    return kinds


def _load_trace(trace_dir: str) -> list[dict]:
    path = sorted(Path(trace_dir).rglob("*.trace.json.gz"))[-1]
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def breakdown(events: list[dict], kinds: dict[str, str], walls: list[float], module: str) -> dict[str, float]:
    """Per-step milliseconds of each part (medians over steps); module: the step executable's HLO module name."""
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if args.get("hlo_module") == module and "run_id" in args:
            runs[args["run_id"]].append(e)
    per_run = []
    for ops in runs.values():
        # loops and conditionals: the ops of their bodies and branches are counted
        ops = [e for e in ops if not e["name"].startswith(("while", "cond"))]
        start, end = min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops)
        count = collections.Counter(e["args"]["hlo_op"] for e in ops)
        parts = dict.fromkeys(PARTS, 0.0)
        for e in ops:
            op = e["args"]["hlo_op"]
            kind, inside = kinds.get(op, "other"), count[op] > 1  # the layer loop runs its body once a layer
            if kind == "attention":
                parts["attention"] += e["dur"]
            elif inside:
                parts["layer matmuls" if kind == "matmul" else "other layer ops"] += e["dur"]
            else:
                parts["LM head" if kind == "matmul" else "sampling and rest"] += e["dur"]
        parts["sampling and rest"] += max(0.0, (end - start) - sum(parts.values()))  # between ops
        per_run.append((start, end, parts))
    per_run.sort(key=lambda r: r[0])
    result = {p: statistics.median(r[2][p] for r in per_run) / 1e3 for p in PARTS if p != "host"}
    device_ms = statistics.median((r[1] - r[0]) / 1e3 for r in per_run)
    result["host"] = max(0.0, statistics.median(walls) * 1e3 - device_ms)
    result["step"] = statistics.median(walls) * 1e3
    result["runs"] = len(per_run)
    return result


def measure(batch: int, steps: int, quantization: str | None, kv_cache_dtype: str | None = None,
            model: str | None = None) -> dict:
    from jaxllm import LLM, SamplingParams

    options = {} if quantization is None else {"quantization": quantization}
    if model is not None:
        options["model"] = model
    if kv_cache_dtype is not None:
        options["kv_cache_dtype"] = kv_cache_dtype
    llm = LLM(preset="smollm2-cpu", max_num_seqs=max(batch, 1), **options)
    engine = llm.engine
    work = workload.load()
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    for i in range(batch):  # the workload's token ids, modulo another model's smaller vocabulary (speed only)
        engine.add_request(f"r{i}", [t % vocab for t in work["prompts"][i % len(work["prompts"])]], params)
    while engine.scheduler.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # prefill, until every sequence decodes
    for _ in range(4):
        engine.step()
    bucket = engine.runner.bucket_for(batch, batch)
    text = engine.runner.build(bucket).as_text()
    kinds, module = op_kinds(text), re.match(r"HloModule ([^\s,]+)", text).group(1)
    walls = []
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        jax.profiler.stop_trace()
        events = _load_trace(trace_dir)
    result = breakdown(events, kinds, walls, module)
    result.update(batch=batch, bucket=list(bucket), quantization=quantization or "default",
                  kv_cache_dtype=jax.numpy.dtype(engine.kv_cache_dtype).name,
                  int8_path=engine.model.kernels.int8_isa)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,32")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--quantization", help="engine quantization (default: the preset's)")
    p.add_argument("--kv-cache-dtype", help="KV cache dtype (default: the preset's)")
    p.add_argument("--model", help="model path (default: the preset's, the embedded GGUF)")
    p.add_argument("--json")
    args = p.parse_args()
    results = [measure(int(b), args.steps, args.quantization, args.kv_cache_dtype, args.model)
               for b in args.batch.split(",")]
    print(f"{'batch':>5s} {'step ms':>8s} " + " ".join(f"{part:>17s}" for part in PARTS))
    for r in results:
        print(f"{r['batch']:5d} {r['step']:8.2f} " + " ".join(
            f"{r[part]:8.2f} ms {100 * r[part] / r['step']:4.0f}%" for part in PARTS))
    host = machine.describe()
    print(machine.line(host))
    if args.json:  # rows, as before; each names the machine
        Path(args.json).write_text(json.dumps([{**r, "machine": host} for r in results], indent=1))


if __name__ == "__main__":
    main()
