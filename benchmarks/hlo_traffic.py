"""What a compiled XLA program moves through device memory, read from its optimized HLO text
(`jax.stages.Compiled.as_text()`).

Every kernel the program launches (a fusion, a custom call, a copy, an unfused op) is one `Kernel` with the
bytes it reads and writes, counted the way the hardware sees them:
- a fusion's parameter read only through slices, dynamic slices or gathers costs what those read, not the whole
  operand (a GEMM reading one layer of a stacked weight reads one layer);
- a parameter updated in place (operand 0 of a dynamic-update-slice or scatter) costs nothing to read, and the
  output then costs the update's bytes, not the whole buffer (the KV cache write);
- a while loop's body counts its known trip count times; a conditional counts its cheapest branch (the path of
  a step that needs none of the optional work: greedy sampling, no penalties, no grammar), and its branches are
  listed so the dearer ones stay visible;
- a cuBLAS GEMM's workspace output (XLA's last tuple element, s8) is scratch, not written data;
- a custom call reads all its operands unless the caller says otherwise (`custom_bytes`: a Pallas kernel that
  reads only the KV pages its block tables name).

It also flags the kernels that only move data: a fusion whose output is a slice, transpose or copy of one of its
parameters, and plain copies. Pure text parsing: it runs wherever the HLO text came from.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
               "token": 0}
FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "opt-barrier", "after-all",
        "add-dependency", "partition-id", "replica-id"}
MOVES = {"dynamic-slice", "slice", "copy", "transpose", "bitcast", "reshape"}  # ops that only move data
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\((.*)\)\s+->\s+(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")


def _dtype_bytes(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return 1 if dtype.startswith("f8") else 0.5
    return DTYPE_BYTES.get(dtype, 4)


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return int(n * _dtype_bytes(self.dtype))

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_shape(text: str) -> list[Array]:
    """'bf16[8,16]{1,0}' -> [Array]; a tuple shape -> its elements in order."""
    return [Array(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) for m in _ARRAY.finditer(text)]


@dataclasses.dataclass
class Instr:
    name: str
    shape: list[Array]
    opcode: str
    operands: list[str]
    attrs: str
    root: bool

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.shape)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    entry: bool

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instrs}
        self.users: dict[str, list[tuple[Instr, int]]] = {}
        for ins in self.instrs:
            for k, op in enumerate(ins.operands):
                self.users.setdefault(op, []).append((ins, k))

    @property
    def root(self) -> Instr:
        return next(i for i in self.instrs if i.root)


def _split_top(text: str) -> tuple[str, str]:
    """'(a, (b)), rest' -> ('a, (b)', ', rest') for text starting at an opening parenthesis."""
    depth = 0
    for i, c in enumerate(text):
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return text[1:i], text[i + 1:]
    raise ValueError(f"unbalanced: {text[:80]}")


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = m.group(3)
    if rest.startswith("("):
        shape_text, rest = _split_top(rest)
        rest = rest.lstrip()
    else:
        shape_text, _, rest = rest.partition(" ")
    op = re.match(r"([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    inner, attrs = _split_top(rest[op.end() - 1:])
    inner = re.sub(r"/\*.*?\*/", "", inner)
    operands = [t.strip()[1:] for t in inner.split(",") if t.strip().startswith("%")]
    if op.group(1) == "parameter":
        attrs = f"param_index={inner.strip()}" + attrs
    return Instr(m.group(2), parse_shape(shape_text), op.group(1), operands, attrs, bool(m.group(1)))


def parse_module(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name (the entry one has ``entry`` set)."""
    comps: dict[str, Computation] = {}
    current: tuple[str, bool, list[Instr]] | None = None
    for line in text.splitlines():
        if current is None:
            h = _HEADER.match(line)
            if h:
                current = (h.group(2), bool(h.group(1)), [])
            continue
        if line.startswith("}"):
            comps[current[0]] = Computation(current[0], current[2], current[1])
            current = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            current[2].append(ins)
    return comps


@dataclasses.dataclass
class Kernel:
    name: str
    kind: str  # fusion kind (kLoop, kInput, kCustom...), custom-call target, or the opcode
    read: int  # bytes, per launch
    write: int
    count: int  # launches per step (a while body's trip count; 1 otherwise)
    output: str  # the output shape(s)
    moves_only: str | None  # "slice", "copy", ...: a kernel that only moves data (its root op); None otherwise
    source: str | None  # for a data-moving kernel: the shape of the operand it reads from
    gemm: bool = False
    sort: bool = False  # a sort, or a fusion holding one

    @property
    def total(self) -> int:
        return (self.read + self.write) * self.count


@dataclasses.dataclass
class Report:
    kernels: list[Kernel]
    conditionals: list[dict]  # each conditional: its name and the bytes of each branch
    unknown_loops: int  # while loops without a known trip count (counted once)

    @property
    def bytes(self) -> int:
        return sum(k.total for k in self.kernels)

    @property
    def launches(self) -> int:
        return sum(k.count for k in self.kernels)


class _Analyzer:
    def __init__(self, comps: dict[str, Computation], custom_bytes: Callable[[Instr, Computation], int | None]):
        self.comps = comps
        self.custom_bytes = custom_bytes
        self.conditionals: list[dict] = []
        self.unknown_loops = 0

    # -- what a fused computation reads of each parameter and writes --------------------------------------------
    def _param_read(self, comp: Computation, ins: Instr, full: int) -> int:
        total = 0
        for user, k in comp.users.get(ins.name, []):
            if user.opcode == "bitcast":
                total += self._param_read(comp, user, full)
            elif user.opcode in ("dynamic-slice", "slice", "gather") and k == 0:
                total += user.bytes
            elif user.opcode in ("dynamic-update-slice", "scatter") and k == 0:
                pass  # updated in place: the written region is counted as the output
            elif user.opcode == "fusion" and (nested := self.comps.get(user.attr("calls"))) is not None:
                p = self._parameter(nested, k)
                total += self._param_read(nested, p, full) if p is not None else full
            else:
                return full
        return min(total, full)

    @staticmethod
    def _parameter(comp: Computation, index: int) -> Instr | None:
        for ins in comp.instrs:
            if ins.opcode == "parameter" and ins.attrs.startswith(f"param_index={index}"):
                return ins
        return None

    def _written(self, comp: Computation, ins: Instr) -> int:
        if ins.opcode == "tuple":
            return sum(self._written(comp, comp.by_name[o]) for o in ins.operands)
        if ins.opcode == "bitcast":
            return self._written(comp, comp.by_name[ins.operands[0]])
        if ins.opcode == "dynamic-update-slice":
            return comp.by_name[ins.operands[1]].bytes
        if ins.opcode == "scatter":
            return comp.by_name[ins.operands[2]].bytes
        return ins.bytes

    def _moves_only(self, comp: Computation) -> tuple[str | None, str | None]:
        """(root op, source shape) when the fused computation's outputs are slices/copies of a parameter."""
        roots = [comp.by_name[o] for o in comp.root.operands] if comp.root.opcode == "tuple" else [comp.root]
        kinds, sources = set(), set()
        for r in roots:
            op = r
            while op.opcode in MOVES and op.opcode != "dynamic-slice" and op.opcode != "slice" and op.operands and \
                    comp.by_name[op.operands[0]].opcode != "parameter":
                op = comp.by_name[op.operands[0]]
            if op.opcode not in MOVES or op.opcode == "bitcast":
                return None, None
            src = comp.by_name[op.operands[0]]
            while src.opcode == "bitcast":
                src = comp.by_name[src.operands[0]]
            if src.opcode != "parameter":
                return None, None
            kinds.add(op.opcode)
            sources.add(str(src.shape[0]))
        return "/".join(sorted(kinds)), "/".join(sorted(sources))

    # -- kernels of a sequential computation --------------------------------------------------------------------
    def kernels(self, comp: Computation, count: int) -> list[Kernel]:
        out: list[Kernel] = []
        for ins in comp.instrs:
            if ins.opcode in FREE:
                continue
            if ins.opcode == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                trips = int(m.group(1)) if m else 1
                self.unknown_loops += m is None
                for key in ("body", "condition"):
                    out += self.kernels(self.comps[ins.attr(key)], count * trips)
                continue
            if ins.opcode == "conditional":
                names = re.findall(r"(?:true_computation|false_computation)=%([\w.\-]+)", ins.attrs)
                if not names:
                    m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
                    names = [n.strip().lstrip("%") for n in m.group(1).split(",")] if m else []
                branches = [self.kernels(self.comps[n], count) for n in names]
                costs = [sum(k.total for k in b) for b in branches]
                self.conditionals.append({"name": ins.name, "branch_bytes": costs})
                out += branches[costs.index(min(costs))] if branches else []
                continue
            if ins.opcode in ("call", "async-start") and ins.attr("to_apply" if ins.opcode == "call" else "calls"):
                out += self.kernels(self.comps[ins.attr("to_apply" if ins.opcode == "call" else "calls")], count)
                continue
            if ins.opcode in ("async-done", "async-update"):
                continue
            out.append(self._kernel(comp, ins, count))
        return out

    def _kernel(self, comp: Computation, ins: Instr, count: int) -> Kernel:
        operands = [comp.by_name[o] for o in ins.operands if o in comp.by_name]
        if ins.opcode == "fusion":
            fused = self.comps[ins.attr("calls")]
            read = 0
            for k, op in enumerate(operands):
                p = self._parameter(fused, k)
                read += self._param_read(fused, p, op.bytes) if p is not None else op.bytes
            kind = ins.attr("kind") or "fusion"
            gemm = "gemm" in ins.attrs or "cublas" in ins.attrs
            moves, source = (None, None) if gemm else self._moves_only(fused)
            return Kernel(ins.name, kind, read, self._written(fused, fused.root), count,
                          " ".join(map(str, ins.shape)), moves, source, gemm,
                          any(i.opcode == "sort" for i in fused.instrs))
        if ins.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', ins.attrs).group(1)
            special = self.custom_bytes(ins, comp)
            read = special if special is not None else sum(o.bytes for o in operands)
            write = ins.bytes
            if "cublas" in target and len(ins.shape) > 1 and ins.shape[-1].dtype == "s8":
                write -= ins.shape[-1].bytes  # a GEMM's scratch workspace (4 MiB), not data it writes out
            return Kernel(ins.name, target, read, write, count, " ".join(map(str, ins.shape)), None, None,
                          "gemm" in target or "cublas" in target)
        read = sum(o.bytes for o in operands)
        write = ins.bytes
        if ins.opcode == "dynamic-update-slice":
            read, write = operands[1].bytes, operands[1].bytes
        elif ins.opcode == "scatter":
            read, write = operands[2].bytes, operands[2].bytes
        moves = "copy" if ins.opcode in ("copy", "copy-start") else None
        return Kernel(ins.name, ins.opcode, read, write, count, " ".join(map(str, ins.shape)), moves,
                      str(operands[0].shape[0]) if moves and operands and operands[0].shape else None,
                      sort=ins.opcode == "sort")


def analyze(text: str, custom_bytes: Callable[[Instr, Computation], int | None] = lambda ins, comp: None) -> Report:
    """The kernels of the module's entry computation (loops and conditionals expanded as the module docstring
    says). custom_bytes(instr, computation): the bytes a custom call reads, or None for all its operands."""
    comps = parse_module(text)
    entry = next(c for c in comps.values() if c.entry)
    a = _Analyzer(comps, custom_bytes)
    kernels = a.kernels(entry, 1)
    return Report(kernels, a.conditionals, a.unknown_loops)


def summary(report: Report, min_bytes: int = 1 << 20) -> dict:
    """The data-moving kernels of at least `min_bytes` written, grouped by (what, output, source)."""
    groups: dict[tuple, dict] = {}
    for k in report.kernels:
        if k.moves_only and k.write >= min_bytes:
            g = groups.setdefault((k.moves_only, k.output, k.source), {"op": k.moves_only, "output": k.output,
                                                                       "source": k.source, "count": 0, "bytes": 0})
            g["count"] += k.count
            g["bytes"] += k.total
    return {"bytes": report.bytes, "launches": report.launches, "moves": list(groups.values()),
            "sorts": sum(k.count for k in report.kernels if k.sort),
            "conditionals": report.conditionals, "unknown_trip_counts": report.unknown_loops}


def _canonical(comp: Computation, comps: dict[str, Computation]) -> str:
    """A computation's text without its names (operands by position, metadata dropped, called computations by
    their own canonical text): equal for two fusions that compile to the same kernel."""
    at = {ins.name: i for i, ins in enumerate(comp.instrs)}
    lines = []
    for ins in comp.instrs:
        attrs = _METADATA.sub("", ins.attrs)
        attrs = re.sub(r"(calls|to_apply)=%?([\w.\-]+)",
                       lambda m: f"{m.group(1)}=({_canonical(comps[m.group(2)], comps)})" if m.group(2) in comps
                       else m.group(0), attrs)
        operands = ",".join(str(at.get(o, o)) for o in ins.operands)
        lines.append(f"{'ROOT ' if ins.root else ''}{' '.join(map(str, ins.shape))} {ins.opcode}({operands}){attrs}")
    return "\n".join(lines)


def gemm_fusions(text: str) -> tuple[int, int]:
    """(GEMM kernels in the module, distinct ones among them): XLA:GPU compiles, and autotunes, each distinct GEMM
    fusion once (its cache keys on the fused computation), so the second number is that work."""
    comps = parse_module(text)
    bodies = []
    for comp in comps.values():
        for ins in comp.instrs:
            gemm = "gemm" in ins.attrs or "cublas" in ins.attrs
            if ins.opcode == "fusion" and gemm and ins.attr("calls") in comps:
                bodies.append(_canonical(comps[ins.attr("calls")], comps))
            elif ins.opcode == "custom-call" and gemm:
                bodies.append(" ".join(map(str, ins.shape)) + _METADATA.sub("", ins.attrs))
    return len(bodies), len(set(bodies))


if __name__ == "__main__":
    import sys

    print(json.dumps(summary(analyze(open(sys.argv[1]).read())), indent=1))
