"""`benchmarks/hlo_traffic.py` on programs XLA:CPU compiles here (its byte-counting rules), and
`benchmarks/gpu_hlo_report.py`'s verdict on the engine's 8B step compiled for an H100, where the CUDA wheels are
installed (this interpreter, or the one JAXLLM_CUDA_PYTHON names); skipped elsewhere."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxllm.engine.sampler import sample

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from hlo_traffic import analyze, gemm_fusions, parse_shape, summary  # noqa: E402

F32 = jnp.float32


def _compiled(fn, *args, **jit_options) -> str:
    return jax.jit(fn, **jit_options).lower(*args).compile().as_text()


def test_shapes_and_tuples_parse_to_bytes():
    assert [a.bytes for a in parse_shape("(bf16[8,16]{1,0}, /*index=1*/f32[], s4[10], pred[3])")] == [256, 4, 5, 3]


def test_a_scans_dynamic_slices_are_copies_counted_every_trip():
    def scanned(w, x):  # w [4, 512, 512]: XLA:CPU copies each layer's slice out before its dot
        def body(x, i):
            return jnp.tanh(x @ jax.lax.dynamic_index_in_dim(w, i, keepdims=False).T), None
        return jax.lax.scan(body, x, jnp.arange(4))[0]

    text = _compiled(scanned, jax.ShapeDtypeStruct((4, 512, 512), F32), jax.ShapeDtypeStruct((8, 512), F32))
    s = summary(analyze(text), min_bytes=1 << 16)
    (move,) = s["moves"]
    assert (move["op"], move["output"], move["source"], move["count"]) == (
        "dynamic-slice", "f32[512,512]", "f32[4,512,512]", 4)  # the body's copy, times the known trip count
    assert move["bytes"] >= 4 * 2 * 512 * 512 * 4  # read and written
    assert s["bytes"] >= 3 * 4 * 512 * 512 * 4  # each layer's weight: copied (read, write), then read by the dot
    assert s["unknown_trip_counts"] == 0


def test_an_in_place_update_costs_the_update_only():
    def update(cache, new, i):
        return jax.lax.dynamic_update_slice(cache, new, (i, 0))

    text = _compiled(update, jax.ShapeDtypeStruct((4096, 1024), F32), jax.ShapeDtypeStruct((2, 1024), F32),
                     jax.ShapeDtypeStruct((), jnp.int32), donate_argnums=0)
    report = analyze(text)
    assert report.bytes < 3 * 2 * 1024 * 4  # not the 16 MiB buffer
    assert summary(report)["moves"] == []


def _gemm_module(offsets: list[int]) -> str:
    """An XLA:GPU-style module: one GEMM fusion per offset, each reading that static slice of a stacked weight."""
    def fused(i, lo):
        n = f"gemm_fusion.{i}"
        return f"""%{n} (w.{i}: bf16[4,8,8], x.{i}: bf16[2,8]) -> bf16[2,8] {{
  %w.{i} = bf16[4,8,8]{{2,1,0}} parameter(0)
  %s.{i} = bf16[1,8,8]{{2,1,0}} slice(%w.{i}), slice={{[{lo}:{lo + 1}], [0:8], [0:8]}}
  %b.{i} = bf16[8,8]{{1,0}} bitcast(%s.{i})
  %x.{i} = bf16[2,8]{{1,0}} parameter(1)
  ROOT %d.{i} = bf16[2,8]{{1,0}} dot(%x.{i}, %b.{i}), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}, \
metadata={{op_name="jit(f)/layer{i}"}}
}}
"""
    calls = "\n".join(f"  %f{i} = bf16[2,8]{{1,0}} fusion(%w, %x), kind=kCustom, calls=%gemm_fusion.{i}, "
                      f'backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}'
                      for i in range(len(offsets)))
    return (f"HloModule m\n\n{''.join(fused(i, lo) for i, lo in enumerate(offsets))}\n"
            f"ENTRY %main (w: bf16[4,8,8], x: bf16[2,8]) -> bf16[2,8] {{\n  %w = bf16[4,8,8]{{2,1,0}} parameter(0)\n"
            f"  %x = bf16[2,8]{{1,0}} parameter(1)\n{calls}\n  ROOT %t = bf16[2,8]{{1,0}} add(%f0, %f1)\n}}\n")


def test_gemm_fusions_that_differ_only_in_names_are_one():
    """What XLA:GPU compiles and autotunes once: fusions equal but for their names and metadata; static slices at
    other offsets (the layers of a stack) are distinct."""
    assert gemm_fusions(_gemm_module([0, 0, 0])) == (3, 1)
    assert gemm_fusions(_gemm_module([0, 1, 2])) == (3, 3)


def test_the_samplers_greedy_path_has_no_sort():
    """The vocabulary sort (top-k/top-p) sits only in the branch a sampling row takes: the cheapest path through
    the program's conditionals (a greedy step) has none, though the program holds one."""
    from tests.engine.test_sampler import tensors

    text = _compiled(sample, jnp.zeros((8, 4096), F32), tensors(8, temperature=0.0))
    assert text.count(" sort(") >= 1
    report = analyze(text)
    assert summary(report)["sorts"] == 0 and report.conditionals
    # the greedy branch reads the logits about once (plus the blocked argmax's padded copy on CPU)
    assert report.bytes < 3 * 8 * 4096 * 4


def _cuda_python() -> str | None:
    named = os.environ.get("JAXLLM_CUDA_PYTHON")
    if named:
        return named
    present = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return sys.executable if present else None


@pytest.mark.slow
@pytest.mark.skipif(_cuda_python() is None, reason="the CUDA wheels are not installed (pip install "
                    "'jax[cuda12]==<jax version>', or set JAXLLM_CUDA_PYTHON to an interpreter that has them)")
def test_the_8b_step_compiled_for_an_h100_reads_each_weight_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([_cuda_python(), "benchmarks/gpu_hlo_report.py", "--buckets", "1x1,32x32,256x256,2048x256",
                          "--json", str(tmp_path / "after.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["layer_loop"] == "unrolled" and after["verdict"]["ok"]
    for row in after["rows"]:
        assert row["weight_slices"] == 0 and row["sorts_on_greedy_path"] == 0, row
        if row["bucket"] == "1x1":  # a decode step of few rows multiplies in the Pallas skinny matmul, not cuBLAS
            assert row["gemm_kernels"] == 0 and row["skinny_matmul_calls"] >= 4 * 32 + 1, row
        else:  # each weight's GEMM compiled once, not once per layer
            assert row["distinct_gemm_fusions"] <= 16 < row["gemm_kernels"] and row["skinny_matmul_calls"] == 0, row
        if row["decode"]:
            assert row["ratio"] <= 1.15, row
    # ...which fails for the stacked layers unrolled: each layer's GEMMs read other static slices of the stacks
    # (32 rows: cuBLAS; a step of 16 rows or fewer multiplies in the Pallas kernel, which reads a separate weight)
    run = subprocess.run([_cuda_python(), "benchmarks/gpu_hlo_report.py", "--buckets", "32x32", "--layout", "stacked",
                          "--json", str(tmp_path / "stacked.json")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = json.loads((tmp_path / "stacked.json").read_text())["rows"]
    # (at 32 rows XLA copies the static slices out; at one row, with cuBLAS, it fused them into 129 distinct GEMMs)
    assert row["weight_slices"] == 4 * 32 or row["distinct_gemm_fusions"] > 4 * 32, row
    # The check can fail: the scanned layer loop copies every layer's weights out before its GEMMs.
    run = subprocess.run([_cuda_python(), "benchmarks/gpu_hlo_report.py", "--buckets", "1x1", "--layer-loop", "scan",
                          "--json", str(tmp_path / "before.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = json.loads((tmp_path / "before.json").read_text())["rows"]
    assert row["weight_slices"] == 4 * 32 and row["ratio"] > 2
