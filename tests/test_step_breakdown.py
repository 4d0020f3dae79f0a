"""`benchmarks/step_breakdown.py`: the profiled decode steps of the embedded model are found in the trace (by the
step executable's own module name, whatever the engine calls its step) and split into parts that account for the
step's wall time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("attention", "layer matmuls", "other layer ops", "LM head", "sampling and rest", "host")


@pytest.mark.slow  # ~90 s: the embedded model's buckets, then a profiled trace
def test_a_decode_step_is_split_into_its_parts(tmp_path):
    out = tmp_path / "breakdown.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "benchmarks/step_breakdown.py", "--batch", "1", "--steps", "3",
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["batch"] == 1 and row["runs"] == 3, row
    assert row["attention"] > 0 and row["layer matmuls"] > 0 and row["LM head"] > 0, row
    assert all(row[p] >= 0 for p in PARTS), row
    # each part is a median over the steps, so their sum is near the median step, not equal to it
    assert abs(sum(row[p] for p in PARTS) - row["step"]) < 0.25 * row["step"], row
