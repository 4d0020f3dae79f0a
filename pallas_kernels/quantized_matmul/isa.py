"""Which integer dot-product instructions this CPU has, for the int8-activation quantized matmul.

The kernel's inner step multiplies 64 unsigned bytes by 64 signed bytes and sums each run of 4 products into one of
16 int32 lanes. Three instruction sets do that, widest first:

- ``vnni512``: AVX-512 VNNI ``vpdpbusd`` on 512-bit registers (one instruction);
- ``vnni256``: ``vpdpbusd`` on 256-bit registers (AVX-VNNI, or AVX-512 VNNI with VL), two instructions;
- ``avx2``: ``vpmaddubsw`` (pairs into int16) then ``vpmaddwd`` against ones (pairs into int32), four.

Every path computes the same exact int32 lanes (no int16 saturation: the kernel keeps each product pair under
2 * 128 * 127), so the kernel's results are bit-identical whichever one runs. The choice is made once, from the
features LLVM reports for the host, because a path compiled for instructions the CPU lacks cannot even be built
(LLVM fails to select them). ``JAXLLM_CPU_INT8_ISA`` (one of ISAS, or ``none``) overrides it, e.g. to compare
paths; asking for one this CPU cannot run is an error.
"""

from __future__ import annotations

import functools
import os

ISAS = ("vnni512", "vnni256", "avx2")  # widest first
ENV = "JAXLLM_CPU_INT8_ISA"


@functools.cache
def _features() -> dict[str, bool]:
    import llvmlite.binding as llvm
    return {k: bool(v) for k, v in llvm.get_host_cpu_features().items()}


def supported(isa: str) -> bool:
    """Whether this CPU runs `isa`'s instructions."""
    f = _features()
    if isa == "vnni512":
        return f.get("avx512vnni", False) and f.get("avx512bw", False)
    if isa == "vnni256":
        return f.get("avxvnni", False) or (f.get("avx512vnni", False) and f.get("avx512vl", False))
    if isa == "avx2":
        return f.get("avx2", False)
    raise ValueError(f"unknown integer dot-product instruction set {isa!r}; choose one of {ISAS}")


def available() -> tuple[str, ...]:
    """The paths this CPU runs, widest first."""
    return tuple(isa for isa in ISAS if supported(isa))


def best() -> str | None:
    """The path the kernel uses here: ``JAXLLM_CPU_INT8_ISA`` if set, else the widest this CPU runs (None: no
    integer path, the float-activation kernel serves)."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted:
        if wanted == "none":
            return None
        if not supported(wanted):
            raise ValueError(f"{ENV}={wanted}: {describe()}; cannot run it")
        return wanted
    paths = available()
    return paths[0] if paths else None


def describe() -> str:
    """For messages: the int8 paths this CPU runs."""
    return f"this CPU runs: {', '.join(available()) or 'no integer path'}"
