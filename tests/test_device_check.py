"""`benchmarks/device_check.py --smoke`: every part of the accelerator check runs on this CPU at tiny shapes and
passes (the same code an H100 or TPU host runs at full size)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_smoke_run_passes_every_part(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as a plain CPU host has
    run = subprocess.run([sys.executable, "benchmarks/device_check.py", "--smoke", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    parts = report["parts"]
    assert len(parts) == 5 and all(p["ok"] for p in parts.values()), parts
    parity = parts["1 kernel parity"]["rows"]
    assert {r["dtype"] for r in parity} == {"float32", "bfloat16"} and all(r["ok"] for r in parity)
    assert any(r["kernel"] == "cpu" for r in parity)  # the native kernel of this platform was checked
    agreement = parts["3 engine agreement (this device vs the CPU engine, greedy)"]
    assert agreement["recompiles_while_running"] == 0
    assert [(r["dtype"], r["prompts"]) for r in agreement["rows"]] == [("float32", 2), ("bfloat16", 2)]
    assert agreement["rows"][0]["identical"] == 2  # float32 here is the CPU engine's own arithmetic
    roofline = parts["4 8B-shaped roofline"]
    assert roofline["recompiles_while_running"] == 0 and all(r["decode_tok_s"] > 0 for r in roofline["rows"])
    # the profile of decode steps: every traced kernel placed, the step's time split by kind
    profile = roofline["profiles"]["decode 4"]
    assert profile["steps"] >= 1 and profile["annotated"] > 0.9, profile
    assert profile["busy_ms"] > 0 and abs(sum(profile["kinds_ms"].values()) - profile["busy_ms"]) < profile["busy_ms"]
    assert {"attention", "matmul"} <= set(profile["kinds_ms"]), profile
    assert "prefill" in roofline["profiles"]
    skinny = parts["5 skinny matmul speed"]  # every weight of the model at each row count, and the sweep
    assert {(r["weight"], r["rows"]) for r in skinny["rows"]} == {
        (w, t) for w in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head") for t in (1, 3)}
    assert all(r["rel_err"] < 1e-2 and r["kernel_us"] > 0 and r["xla_us"] > 0 for r in skinny["rows"])
    assert sum(r["table"] for r in skinny["sweep"]) == 5 and all("us" in r for r in skinny["sweep"]), skinny["sweep"]
    text = (tmp_path / "device_check.md").read_text()
    assert "## 4 8B-shaped roofline: ok" in text and "### profile: decode 4" in text
