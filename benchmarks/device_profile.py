"""Where a step's device time goes: a JAX profiler trace of the engine at work, summarised per kind of kernel.

`profile(run, logdir, hlo_texts)` traces `run()` and returns, per engine step: the device's busy time by kind
(matmul, attention, KV write, sampler, copies, norm/elementwise, host transfers), the idle time between kernels
(host gaps), and the kernels that cost most, each with the bytes the compiled program says it moves
(`hlo_traffic`) and so the bandwidth it reached. A kernel is placed by its HLO instruction (the trace names it
in each kernel's annotation): a GEMM, the Pallas attention call, a data-moving kernel, a sort; else by the
named scope it came from (`sampler`, `kv_write`, `logits`, as the engine's step names them).

The trace is read with `jax.profiler.ProfileData` (no TensorBoard): the device planes on a GPU or TPU, the XLA
thunks of the host plane on a CPU (where the numbers only exercise the code).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

KINDS = ("matmul", "attention", "kv_write", "sampler", "copies", "norm/elementwise", "host transfers")
_ANNOTATED = re.compile(r"hlo_op=([\w.\-]+)")
_MODULE = re.compile(r"hlo_module=([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DERIVED = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework", "Source code", "Launch Stats",
            "Async XLA Ops", "SparseCore")  # lines the profiler derives from the kernels (double counting)


@dataclasses.dataclass(frozen=True)
class Event:
    name: str  # the kernel's name
    op: str  # its HLO instruction (the kernel's name where the trace carries none)
    module: str | None
    start_ns: float
    dur_ns: float


@dataclasses.dataclass(frozen=True)
class OpInfo:
    kind: str
    per_step: int  # launches in one step (a loop body's trip count)
    bytes: int  # per launch, as hlo_traffic counts them


def _stats(ev) -> dict:
    try:
        return dict(ev.stats)
    except Exception:  # noqa: BLE001 (a stat of a type the bindings cannot convert)
        return {}


def device_events(trace_file: str) -> tuple[list[Event], dict]:
    """The kernels of a trace (device planes; on a CPU, the host's XLA thunks) and what the planes held."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(trace_file)
    planes = list(data.planes)
    seen = {p.name: [(line.name, sum(1 for _ in line.events)) for line in p.lines] for p in planes}
    devices = [p for p in planes if p.name.startswith("/device:") and "CUSTOM" not in p.name]
    events = []
    for plane in devices or [p for p in planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if devices and line.name.startswith(_DERIVED):
                continue
            if not devices and not line.name.startswith("tf_XLA"):
                continue
            for ev in line.events:
                stats = _stats(ev)
                text = " ".join(str(v) for v in stats.values() if isinstance(v, str))
                op = stats.get("hlo_op") if isinstance(stats.get("hlo_op"), str) else None
                if op is None and (m := _ANNOTATED.search(text)):
                    op = m.group(1)
                module = stats.get("hlo_module") if isinstance(stats.get("hlo_module"), str) else None
                if module is None and (m := _MODULE.search(text)):
                    module = m.group(1)
                if not devices and op is None:
                    continue  # thread-pool bookkeeping on the CPU
                if ev.duration_ns <= 0:
                    continue
                events.append(Event(ev.name, op or ev.name, module, ev.start_ns, ev.duration_ns))
    events.sort(key=lambda e: e.start_ns)
    return events, seen


def host_events(trace_file: str, steps: int, top: int = 14) -> list[dict]:
    """The host's dearest events of a trace, by name: calls and inclusive ms a step; the `top` Python frames and
    the `top` events of the runtime's threads (its work to launch a step's kernels: under the profiler XLA:GPU
    runs a step without CUDA graphs, so their updates never show here).
    Nested events each count their whole span; the profiler's own frames are left out."""
    from jax.profiler import ProfileData
    totals: dict[tuple[str, bool], list] = {}
    for plane in ProfileData.from_file(trace_file).planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            python = line.name.startswith("python")
            for ev in line.events:
                if ev.duration_ns > 0 and not (python and ("profiler.py" in ev.name or "contextlib" in ev.name)):
                    row = totals.setdefault((ev.name[:90], python), [0, 0.0, line.name[:40]])
                    row[0] += 1
                    row[1] += ev.duration_ns
    rows = []
    for python in (True, False):
        mine = sorted(((k[0], v) for k, v in totals.items() if k[1] == python), key=lambda kv: -kv[1][1])[:top]
        rows += [{"event": name, "thread": thread, "calls_per_step": round(n / steps, 2),
                  "ms_per_step": round(total / steps / 1e6, 3)} for name, (n, total, thread) in mine]
    return rows


def hlo_ops(text: str) -> dict[str, OpInfo]:
    """Each kernel of a compiled program (`Compiled.as_text()`) by its instruction name: kind, launches a step,
    bytes a launch."""
    from hlo_traffic import analyze, parse_module
    comps = parse_module(text)
    instrs = {ins.name: ins for comp in comps.values() for ins in comp.instrs}
    scope = {name: (m.group(1) if (m := _OP_NAME.search(ins.attrs)) else "") for name, ins in instrs.items()}

    def has_dot(name: str) -> bool:  # a fusion around a dot (XLA:CPU's library fusions; GEMMs carry `gemm`)
        called = instrs[name].attr("calls") if name in instrs else None
        return called in comps and any(i.opcode in ("dot", "convolution") for i in comps[called].instrs)

    out = {}
    for k in analyze(text).kernels:
        name = scope.get(k.name, "")
        if k.gemm or k.kind in ("dot", "convolution") or has_dot(k.name):
            kind = "matmul"
        elif "attention" in name or "attention" in k.kind or ("triton" in k.kind and "kv_write" not in name):
            kind = "attention"
        elif "kv_write" in name:
            kind = "kv_write"
        elif k.sort or "sampler" in name:
            kind = "sampler"
        elif k.moves_only:
            kind = "copies"
        else:
            kind = "norm/elementwise"
        out[k.name] = OpInfo(kind, k.count, k.read + k.write)
    for comp in comps.values():  # loops and branches: their kernels are timed, not the containers (XLA:CPU)
        for ins in comp.instrs:
            if ins.opcode in ("while", "conditional", "call"):
                out[ins.name] = OpInfo("container", 0, 0)
    return out


def _key(name: str) -> str:
    """XLA names a fusion's GPU kernel after its instruction with '.' as '_' (fusion.12 -> fusion_12)."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _kind_by_name(name: str) -> str:
    low = name.lower()
    if "memcpy" in low or "memset" in low:
        return "host transfers"
    if any(w in low for w in ("gemm", "cublas", "nvjet", "xmma", "cutlass", "matmul", "dot")):
        return "matmul"
    if "attention" in low:
        return "attention"
    if "copy" in low or "transpose" in low:
        return "copies"
    return "norm/elementwise"


def summarize(events: list[Event], ops: dict[str, OpInfo], steps: int | None = None, top: int = 12) -> dict:
    """Per step: busy time by kind, idle time between kernels, and the dearest kernels (with GB/s); and the share
    of kernels matched to an instruction of the program (`annotated`)."""
    by_key = {_key(op): op for op in ops}  # a kernel named after its instruction, where its annotation is missing
    events = [e if e.op in ops else dataclasses.replace(e, op=by_key.get(_key(e.op)) or by_key.get(_key(e.name))
                                                          or e.op) for e in events]
    annotated = round(sum(e.op in ops for e in events) / max(1, len(events)), 3)
    events = [e for e in events if not (e.op in ops and ops[e.op].kind == "container")]
    if not events:
        return {"error": "no kernels in the trace"}
    if steps is None:  # launches observed over launches a step, for the instructions the program names
        ratios = [n / ops[op].per_step for op, n in collections.Counter(e.op for e in events).items()
                  if op in ops and ops[op].per_step]
        steps = max(1, round(float(np.median(ratios)))) if ratios else 1
    start = events[0].start_ns
    end = max(e.start_ns + e.dur_ns for e in events)
    busy, covered = 0.0, start  # the union of kernel intervals: streams may overlap
    for e in events:
        stop = e.start_ns + e.dur_ns
        if stop > covered:
            busy += stop - max(covered, e.start_ns)
            covered = stop
    by_kind: dict[str, float] = collections.defaultdict(float)
    by_op: dict[str, list] = {}
    for e in events:
        info = ops.get(e.op)
        kind = "host transfers" if "memcpy" in e.name.lower() else (info.kind if info else _kind_by_name(e.name))
        by_kind[kind] += e.dur_ns
        row = by_op.setdefault(e.op, [e.name, kind, 0, 0.0])
        row[2] += 1
        row[3] += e.dur_ns
    window = end - start
    rows = []
    for op, (name, kind, n, total) in sorted(by_op.items(), key=lambda kv: -kv[1][3])[:top]:
        info = ops.get(op)
        per = total / n
        rows.append({"op": op, "kernel": name[:60], "kind": kind, "launches_per_step": round(n / steps, 2),
                     "us_per_step": round(total / steps / 1e3, 1), "us_per_launch": round(per / 1e3, 2),
                     "MB_per_launch": round(info.bytes / 1e6, 2) if info else None,
                     "GB_s": round(info.bytes / per, 1) if info else None})
    return {"steps": steps, "kernels": len(events), "annotated": annotated, "step_ms": round(window / steps / 1e6, 3),
            "busy_ms": round(busy / steps / 1e6, 3), "idle_ms": round((window - busy) / steps / 1e6, 3),
            "launches_per_step": round(len(events) / steps, 1),
            "kinds_ms": {k: round(by_kind.get(k, 0.0) / steps / 1e6, 3) for k in KINDS if by_kind.get(k)},
            "top": rows}


def profile(run: Callable[[], object], logdir: str | Path, hlo_texts: list[str], steps: int | None = None) -> dict:
    """Traces `run()` into `logdir` (emptied first) and summarises it (`summarize`)."""
    import jax
    logdir = Path(logdir)
    shutil.rmtree(logdir, ignore_errors=True)
    with jax.profiler.trace(str(logdir)):
        run()
    files = sorted(glob.glob(str(logdir / "**" / "*.xplane.pb"), recursive=True))
    if not files:
        return {"error": f"no trace written under {logdir}"}
    events, seen = device_events(files[-1])
    ops: dict[str, OpInfo] = {}
    for text in hlo_texts:
        ops |= hlo_ops(text)
    out = summarize(events, ops, steps)
    if "steps" in out:
        out["host_top"] = host_events(files[-1], out["steps"])
    out["planes"] = {name: lines[:8] for name, lines in seen.items()}
    out["sample_events"] = [dataclasses.asdict(e) for e in events[:5]]  # what the trace names a kernel by
    return out
