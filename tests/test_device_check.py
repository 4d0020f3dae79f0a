"""`benchmarks/device_check.py --smoke`: every part of the accelerator check runs on this CPU at tiny shapes and
passes (the same code an H100 or TPU host runs at full size)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_smoke_run_passes_every_part(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as a plain CPU host has
    run = subprocess.run([sys.executable, "benchmarks/device_check.py", "--smoke", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    parts = report["parts"]
    assert len(parts) == 4 and all(p["ok"] for p in parts.values()), parts
    parity = parts["1 kernel parity"]["rows"]
    assert {r["dtype"] for r in parity} == {"float32", "bfloat16"} and all(r["ok"] for r in parity)
    assert any(r["kernel"] == "cpu" for r in parity)  # the native kernel of this platform was checked
    agreement = parts["3 engine agreement (SmolLM2 bfloat16 vs CPU float32)"]
    assert agreement["recompiles_while_running"] == 0 and agreement["prompts"] == 2
    roofline = parts["4 8B-shaped roofline"]
    assert roofline["recompiles_while_running"] == 0 and all(r["decode_tok_s"] > 0 for r in roofline["rows"])
    assert "## 4 8B-shaped roofline: ok" in (tmp_path / "device_check.md").read_text()
