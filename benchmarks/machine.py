"""The machine a benchmark ran on, printed beside its tables and saved with its results: CPU model, cores, L3, and
the instruction-set features that decide which kernels llama.cpp and jaxllm pick (AVX2, AVX-512, VNNI, BF16, AMX).
Figures from two machines are not comparable; ratios measured in one run on one machine are."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path

ISA = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
       "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve", "i8mm", "dotprod")


def describe() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "l3": None, "isa": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    if m := re.search(r"^model name\s*:\s*(.+)$", text, re.M):
        info["cpu"] = m.group(1).strip()
    if m := re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M):
        flags = set(m.group(1).split())
        info["isa"] = [f for f in ISA if f in flags]
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        if m := re.search(r"^L3 cache:\s*(.+)$", lscpu, re.M):
            info["l3"] = m.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from pallas_kernels.quantized_matmul import isa

    info["int8_path"] = isa.best() or "none"  # jaxllm's quantized matmul: its integer path, or float activations
    return info


def line(info: dict | None = None) -> str:
    info = info or describe()
    return (f"machine: {info['cpu']}, {info['cores']} cores, L3 {info['l3'] or '?'}; "
            f"ISA: {' '.join(info['isa']) or '?'}; jaxllm int8 path: {info.get('int8_path', '?')}")


if __name__ == "__main__":
    print(line())


def save(path: str | None, host: dict, **fields) -> None:
    """A benchmark's results as JSON beside the machine they came from (`describe`); nothing without a path."""
    if path:
        Path(path).write_text(json.dumps({"machine": host, **fields}, indent=1))
