"""The int8 kernel's inner loops as the CPU runs them: compiles one path's chunk loop (`cpu_int8_kernel._chunk`)
for this host and, for its loops with the most integer dot products (the 4-pair bodies of its passes), counts
instructions, those that touch the stack (spills and reloads; the scale broadcasts when they are loads) and
instructions per (weight row, input, pair of 32-value blocks), with the commonest opcodes. A register-pressure
check for a kernel edit that needs no timing on a noisy machine.

    python benchmarks/int8_kernel_asm.py [--isa avx2] [--bits 4] [--loops 2]
"""

from __future__ import annotations

import argparse
import collections
import re

import numba
from numba import types

from pallas_kernels.quantized_matmul import cpu_int8_kernel, isa


def loops(asm: str) -> list[tuple[str, list[str]]]:
    """(label, instructions) of every basic block holding a `vpmaddubsw` or `vpdpbusd`."""
    blocks, name, body = [], "entry", []
    for line in asm.splitlines():
        if re.match(r"^\.LBB", line):
            blocks.append((name, body))
            name, body = line.rstrip(":"), []
        elif line.strip() and not line.strip().startswith((".", "#")):
            body.append(line.strip())
    blocks.append((name, body))
    return [(n, b) for n, b in blocks if any(re.match(r"(vpmaddubsw|vpdpbusd)\b", i) for i in b)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", default=isa.best() or "avx2")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--loops", type=int, default=2)
    args = p.parse_args()
    if not isa.supported(args.isa):
        raise SystemExit(f"{args.isa}: {isa.describe()}")
    chunk = numba.cfunc(types.void(types.int64, types.int64), cache=False, error_model="numpy",
                        boundscheck=False)(cpu_int8_kernel._chunk(args.isa, args.bits, True))
    found = loops(chunk._library.get_asm_str())  # numba's cfuncs have no public inspect_asm
    dots_per_pair = 1 if args.isa == "vnni512" else 2  # a pair's 64 values: one 512-bit register or two of 256
    found.sort(key=lambda nb: -sum(i.startswith(("vpmaddubsw", "vpdpbusd")) for i in nb[1]))
    print(f"{args.isa}, {args.bits}-bit weights, passes {cpu_int8_kernel.BLOCKS[args.isa]} (rows, inputs)")
    for name, body in found[:args.loops]:
        dots = sum(i.startswith(("vpmaddubsw", "vpdpbusd")) for i in body)
        stack = sum("rsp" in i for i in body)
        print(f"{name}: {len(body)} instructions, {stack} touch the stack, "
              f"{len(body) / (dots / dots_per_pair):.1f} per (row, input, pair)")
        print("   ", collections.Counter(i.split()[0] for i in body).most_common(12))


if __name__ == "__main__":
    main()
