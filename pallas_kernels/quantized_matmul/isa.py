"""Which integer dot-product instructions this CPU has, for the int8-activation quantized matmul.

Four paths, widest first:

- ``amx``: Intel AMX tiles (``tdpbssd``/``tdpbsud``), 16 inputs x 16 weight rows x 32 values an instruction, with
  AVX-512 VNNI lane passes for steps of fewer than 16 inputs (`cpu_amx_kernel`). It sums whole 32-value blocks
  exactly before scaling them, so its results differ from the lane paths' by float32 rounding (it is batch
  invariant on its own: every step size gets the same block sums and float work). It is used only when asked for
  (``JAXLLM_CPU_INT8_ISA=amx``): it reads the weights in row order and lays each block out for the tiles in
  the step, so its decode steps are slower than ``vnni512``'s (see docs/models.md), its bigger steps faster.
- ``vnni512``: AVX-512 VNNI ``vpdpbusd`` on 512-bit registers (one instruction);
- ``vnni256``: ``vpdpbusd`` on 256-bit registers (AVX-VNNI, or AVX-512 VNNI with VL), two instructions;
- ``avx2``: ``vpmaddubsw`` (pairs into int16) then ``vpmaddwd`` against ones (pairs into int32), four.

``vnni512`` also has loops for weights interleaved by 16 rows (`interleave`, `cpu_x16_kernel`), which an engine
lays out at load where this path is chosen: they sum whole blocks as ``amx`` does (bit-identical to it) and run
every step size 1.0-2.7x as fast as the lane loops on SmolLM2's shapes (docs/performance.md). The lane loops serve
what is not interleaved (formats without 32-value groups, weights split over devices, a model passed in).

The three lane paths multiply 64 unsigned bytes by 64 signed bytes and sum each run of 4 products into one of 16
int32 lanes, the same exact lanes on every one (no int16 saturation: the kernel keeps each product pair under
2 * 128 * 127), so their results are bit-identical whichever runs. The choice is made once, from the features LLVM
reports for the host, because a path compiled for instructions the CPU lacks cannot even be built (LLVM fails to
select them). ``JAXLLM_CPU_INT8_ISA`` (one of ISAS, or ``none``) overrides it, e.g. to compare paths; asking for
one this CPU cannot run is an error.
"""

from __future__ import annotations

import functools
import os

ISAS = ("amx", "vnni512", "vnni256", "avx2")  # widest first
CHOSEN = ISAS[1:]  # the paths `best` picks from unasked
ENV = "JAXLLM_CPU_INT8_ISA"


@functools.cache
def host_features() -> dict[str, bool]:
    """The CPU features LLVM reports for this host (what numba compiles for)."""
    import llvmlite.binding as llvm
    return {k: bool(v) for k, v in llvm.get_host_cpu_features().items()}


def supported(isa: str) -> bool:
    """Whether this CPU runs `isa`'s instructions."""
    f = host_features()
    if isa == "amx":
        return f.get("amx-int8", False) and f.get("amx-tile", False) and f.get("avx512bw", False) and _permitted()
    if isa == "vnni512":
        return f.get("avx512vnni", False) and f.get("avx512bw", False)
    if isa == "vnni256":
        return f.get("avxvnni", False) or (f.get("avx512vnni", False) and f.get("avx512vl", False))
    if isa == "avx2":
        return f.get("avx2", False)
    raise ValueError(f"unknown integer dot-product instruction set {isa!r}; choose one of {ISAS}")


ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 0x1023, 18  # linux/arch/x86/include/uapi/asm/prctl.h, fpu/types.h
SYS_ARCH_PRCTL = 158  # x86-64


@functools.cache
def _permitted() -> bool:
    """Asks Linux for the AMX tile state, once for the process (threads share the grant): True if granted."""
    import ctypes
    import platform
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def request_amx() -> None:
    """Before the first tile instruction: without the grant it kills the process (SIGILL)."""
    if not _permitted():
        raise RuntimeError("Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")


def available() -> tuple[str, ...]:
    """The paths this CPU runs, widest first."""
    return tuple(isa for isa in ISAS if supported(isa))


def best() -> str | None:
    """The path the kernel uses here: ``JAXLLM_CPU_INT8_ISA`` if set, else the widest lane path this CPU runs
    (None: no integer path, the float-activation kernel serves)."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted:
        if wanted == "none":
            return None
        if not supported(wanted):
            raise ValueError(f"{ENV}={wanted}: {describe()}; cannot run it")
        return wanted
    paths = [isa for isa in CHOSEN if supported(isa)]  # (not asking Linux for AMX unless amx is wanted)
    return paths[0] if paths else None


def describe() -> str:
    """For messages: the int8 paths this CPU runs."""
    return f"this CPU runs: {', '.join(available()) or 'no integer path'}"
