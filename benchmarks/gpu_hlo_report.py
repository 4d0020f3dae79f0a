"""What the engine's step does on an H100, read from XLA:GPU's compiled program, on a machine without a GPU.

    python benchmarks/gpu_hlo_report.py [--layer-loop auto|scan|unrolled] [--layout auto|stacked]
        [--buckets 1x1,32x32,256x256,2048x256]
        [--context 1024] [--prompt-len 1024] [--json out.json] [--md out.md]

Needs the CUDA wheels of the installed jax (``pip install "jax[cuda12]==<jax version>"``, ~3 GB; a benchmark-side
tool, not a dependency) and runs with ``JAX_PLATFORMS=cpu`` (set here): XLA:GPU compiles for an H100 described
by a target config (`jax.experimental.topologies`), nothing runs. For each bucket of the llama-3.1-8b-h100
preset's step (the engine's own `ModelRunner` step: forward through the paged cache, LM head, sampler; abstract
bfloat16 weights at Llama-3.1-8B's shapes, the native Pallas GPU attention kernel) it reports:
- the kernels the step launches (and per layer), with the bytes each reads and writes (`hlo_traffic`);
- every materialised weight slice (a kernel that copies a layer's slice of a stacked weight out before a GEMM
  reads it) and every other data-moving kernel of 1 MiB or more;
- the bytes the step moves against the ideal: every weight read once (the embedding table: the step's rows only)
  plus the KV cache read once and the new tokens' KV written. Scenario: a decode bucket (tokens == sequences)
  has every sequence at ``--context`` tokens; a prefill bucket holds prompts of ``--prompt-len`` new tokens.
  The attention kernel is a custom call whose reads of the cache XLA cannot see: it is charged the KV pages its
  grid walks for the scenario (`ragged_paged_attention.gpu.pages_walked`), plus its other operands;
- what the sampler's conditionals cost on their dearer branches (the report follows the greedy path).
- the GEMM kernels and how many distinct GEMM fusions among them: XLA:GPU compiles and autotunes each distinct one
  (on an H100, a bucket of the stacked layers' unrolled step, 133 distinct, took 73-189 s to build; separate
  layers, the engine's layout on GPU, give one fusion per weight).
Verdict: no materialised weight slice, no sort on the greedy path, at most 16 distinct GEMM fusions a bucket, and
bytes <= 1.15x the ideal at every decode bucket. Exit status 1 if
the verdict fails, 2 if the CUDA wheels are missing.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin is only a compiler here (cuInit would fail)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

H100_TARGET = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: 3352320000000
  l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
  driver_version: "12.8.0" }
  platform_name: "CUDA" dnn_version_info { major: 9 minor: 7 } runtime_version { major: 12 minor: 8 patch: 0 }
  device_description_str: "NVIDIA H100 80GB HBM3" """
PRESET = "llama-3.1-8b-h100"
DECODE_LIMIT = 1.15  # bytes moved / ideal, at every decode bucket
# distinct GEMM fusions a bucket compiles and autotunes: each weight's GEMM once, not once per layer (Llama's 4
# layer GEMMs and the LM head, and the prompt-logprobs branch's)
GEMM_FUSION_LIMIT = 16
MIB = 1 << 20


def cuda_plugin_present() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def h100_mesh():
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET, topology="1x1x1")
    return topologies.make_mesh(topo, (1,), ("x",))


def build_runner(layer_loop: str, num_pages: int, layout: str = "auto"):
    import jax.numpy as jnp

    from jaxllm.engine.config import EngineConfig
    from jaxllm.engine.model_runner import ModelRunner
    from jaxllm.kernels import choose_kernels
    from jaxllm.models.llama import LlamaForCausalLM
    from jaxllm.plan import bundled_model_config

    engine = EngineConfig.from_preset(PRESET)
    cfg = bundled_model_config(engine.served_model_name)
    kernels = choose_kernels("auto", engine.matmul_impl, platform="cuda", dtype=jnp.bfloat16, interpret=False,
                             layer_loop=layer_loop)
    model = LlamaForCausalLM(cfg, dtype=jnp.bfloat16, kernels=kernels, rngs=None)  # abstract weights
    model.stack_layers()  # as the loaders return it, then as the engine lays it out for its layer loop
    if layout == "auto":
        model.arrange_layers()
    runner = ModelRunner(model, num_pages=num_pages, page_size=engine.page_size, max_model_len=engine.max_model_len,
                         buckets=engine.buckets(), eos_token_ids=(128009,))
    return runner, cfg, kernels


def scenario(bucket: tuple[int, int], context: int, prompt_len: int) -> tuple[list[int], list[int]]:
    """(query lens, kv lens) of the step the bucket is measured for."""
    tokens, seqs = bucket
    if tokens == seqs:
        return [1] * seqs, [context] * seqs
    n = min(seqs, -(-tokens // prompt_len))
    lens = [tokens // n] * n
    return lens, list(lens)


def analyze_bucket(runner, cfg, mesh, bucket, context: int, prompt_len: int) -> dict:
    import jax
    import numpy as np
    from hlo_traffic import analyze, gemm_fusions, summary
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.ragged_paged_attention.gpu import pages_walked

    def target(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))

    args = jax.tree.map(target, runner.abstract_args(bucket))
    start = time.perf_counter()
    lowered = runner.executables.jitted.lower(*args)
    mid = time.perf_counter()
    # as the engine compiles it
    compiled = lowered.compile(compiler_options=runner.executables.compiler_options or None)
    text = compiled.as_text()
    compile_s = time.perf_counter() - mid
    tokens, seqs = bucket
    q_lens, kv_lens = scenario(bucket, context, prompt_len)
    cache = runner.abstract_caches[0]
    kvh, _, page_size, head_dim = cache.shape
    page_bytes = page_size * head_dim * cache.dtype.itemsize  # one page of one KV head, K or V
    cache_bytes = int(np.prod(cache.shape)) * cache.dtype.itemsize
    walked = pages_walked(q_lens, kv_lens, num_tokens=tokens, num_seqs=seqs, num_kv_heads=kvh,
                          group=cfg.num_heads // cfg.num_kv_heads, head_dim=head_dim, page_size=page_size,
                          max_pages=runner.inputs.max_pages_per_seq)
    attention_kv = walked * kvh * 2 * page_bytes  # per layer: K and V pages walked by every KV head's programs

    def custom_bytes(ins, comp):
        if "ragged_paged_attention" not in ins.attrs or "ragged_paged_attention_gpu_merge" in ins.attrs:
            return None  # the splits' merge reads its operands, the partials, like any kernel
        others = [comp.by_name[o].bytes for o in ins.operands if comp.by_name[o].bytes != cache_bytes]
        return sum(others) + attention_kv

    report = analyze(text, custom_bytes)
    gemms = gemm_fusions(text)
    s = summary(report)
    weights = list(runner.abstract_params)
    stacked = {f"{p.dtype}[{','.join(map(str, p.shape))}]".replace("bfloat16", "bf16").replace("float32", "f32")
               for p in weights if p.ndim == 3 and p.shape[0] == cfg.num_layers}
    weight_slices = [m for m in s["moves"] if m["source"] in stacked]
    other_moves = [m for m in s["moves"] if m["source"] not in stacked]
    weight_bytes = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in weights)
    embed = cfg.vocab_size * cfg.hidden_size * weights[0].dtype.itemsize
    if not cfg.tie_word_embeddings:  # the embedding table is only gathered: the step's rows
        weight_bytes += tokens * cfg.hidden_size * weights[0].dtype.itemsize - embed
    kv_token = cfg.num_layers * 2 * kvh * head_dim * cache.dtype.itemsize
    ideal = weight_bytes + kv_token * (sum(kv_lens) + sum(q_lens))
    attention_calls = sum(k.count for k in report.kernels if k.kind.endswith("triton") and k.output.startswith("f32"))
    return {
        "bucket": f"{tokens}x{seqs}", "decode": tokens == seqs, "query_lens": q_lens[0], "kv_lens": kv_lens[0],
        "lower_s": round(mid - start, 2), "compile_s": round(compile_s, 2),
        "launches": s["launches"], "launches_per_layer": round(s["launches"] / cfg.num_layers, 1),
        "weight_slices": sum(m["count"] for m in weight_slices),
        "weight_slice_bytes": sum(m["bytes"] for m in weight_slices),
        "weight_slice_shapes": sorted({m["output"] for m in weight_slices}),
        "other_moves_over_1MiB": other_moves,
        "bytes": s["bytes"], "ideal_bytes": ideal, "ratio": round(s["bytes"] / ideal, 4),
        "attention_kv_bytes_modelled": attention_kv * cfg.num_layers, "attention_calls": attention_calls,
        "dearer_branches": [c for c in s["conditionals"] if max(c["branch_bytes"]) > 4 * MIB],
        "unknown_trip_counts": s["unknown_trip_counts"],
        "sorts_on_greedy_path": s["sorts"], "sorts_in_module": text.count(" sort("),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "gemm_kernels": gemms[0], "distinct_gemm_fusions": gemms[1],
        "skinny_matmul_calls": text.count('name = "skinny_matmul_gpu"'),  # decode steps of few rows: the Pallas GEMV
    }


def verdict(rows: list[dict]) -> dict:
    decode = [r for r in rows if r["decode"]]
    return {"weight_slices": sum(r["weight_slices"] for r in rows),
            "worst_decode_ratio": max((r["ratio"] for r in decode), default=None),
            "sorts_on_greedy_path": sum(r["sorts_on_greedy_path"] for r in rows),
            "most_distinct_gemm_fusions": max(r["distinct_gemm_fusions"] for r in rows),
            "ok": all(r["weight_slices"] == 0 and r["sorts_on_greedy_path"] == 0
                      and r["distinct_gemm_fusions"] <= GEMM_FUSION_LIMIT for r in rows)
            and all(r["ratio"] <= DECODE_LIMIT for r in decode)}


def markdown(result: dict) -> str:
    gb = 1e9
    lines = [f"# gpu_hlo_report: {PRESET} step compiled for an H100 (layer loop: {result['layer_loop']}, layers "
             f"{result.get('layout', 'stacked')})", "",
             f"jax {result['jax']}; scenario: decode at {result['context']} tokens of context, prefill prompts of "
             f"{result['prompt_len']} tokens", "",
             "| bucket | launches (per layer) | weight slices copied (GB) | other copies >1 MiB (GB) | GB moved | "
             "ideal GB | ratio | sorts (greedy path / module) | GEMM kernels (distinct) | skinny matmuls | temp MB | "
             "compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        other = sum(m["bytes"] for m in r["other_moves_over_1MiB"])
        lines.append(f"| {r['bucket']} | {r['launches']} ({r['launches_per_layer']}) | {r['weight_slices']} "
                     f"({r['weight_slice_bytes'] / gb:.2f}) | {len(r['other_moves_over_1MiB'])} ({other / gb:.3f}) | "
                     f"{r['bytes'] / gb:.2f} | {r['ideal_bytes'] / gb:.2f} | {r['ratio']:.3f} | "
                     f"{r['sorts_on_greedy_path']} / {r['sorts_in_module']} | {r['gemm_kernels']} "
                     f"({r['distinct_gemm_fusions']}) | {r.get('skinny_matmul_calls', 0)} | "
                     f"{r['temp_bytes'] / 1e6:.1f} | "
                     f"{r['compile_s']} |")
    v = result["verdict"]
    lines += ["", f"verdict: {'ok' if v['ok'] else 'FAILED'} (materialised weight slices: {v['weight_slices']}, "
              f"sorts on the greedy path: {v['sorts_on_greedy_path']}, worst decode ratio "
              f"{v['worst_decode_ratio']}, limit {DECODE_LIMIT}; distinct GEMM fusions at most "
              f"{v['most_distinct_gemm_fusions']}, limit {GEMM_FUSION_LIMIT})", ""]
    for r in result["rows"]:
        for m in r["other_moves_over_1MiB"]:
            lines.append(f"- {r['bucket']}: {m['count']} x {m['op']} {m['output']} from {m['source']} "
                         f"({m['bytes'] / gb:.3f} GB)")
        for c in r["dearer_branches"]:
            lines.append(f"- {r['bucket']}: conditional {c['name']} branches {c['branch_bytes']} bytes (greedy path "
                         f"counted: the cheapest)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer-loop", choices=("auto", "scan", "unrolled"), default="auto")
    p.add_argument("--layout", choices=("auto", "stacked"), default="auto",
                   help="the layers as the engine lays them out for the loop (auto), or kept stacked (an unrolled "
                        "loop then reads static slices of the stacks)")
    p.add_argument("--buckets", default="1x1,32x32,256x256,2048x256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    if not cuda_plugin_present():
        print("gpu_hlo_report: the CUDA wheels are not installed (pip install \"jax[cuda12]==<jax version>\")",
              file=sys.stderr)
        return 2
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    buckets = [tuple(int(n) for n in b.split("x")) for b in args.buckets.split(",")]
    runner, cfg, kernels = build_runner(args.layer_loop, num_pages=4096, layout=args.layout)  # shapes only
    mesh = h100_mesh()
    rows = []
    for bucket in buckets:
        row = analyze_bucket(runner, cfg, mesh, bucket, args.context, args.prompt_len)
        rows.append(row)
        print(f"{row['bucket']}: {row['bytes'] / 1e9:.2f} GB vs ideal {row['ideal_bytes'] / 1e9:.2f} "
              f"({row['ratio']:.3f}x), weight slices {row['weight_slices']}, launches {row['launches']}, "
              f"compile {row['compile_s']} s", flush=True)
    result = {"preset": PRESET, "jax": jax.__version__, "layer_loop": kernels.layer_loop, "layout": args.layout,
              "context": args.context,
              "prompt_len": args.prompt_len, "rows": rows, "verdict": verdict(rows)}
    text = markdown(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(text)
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
