"""An A/B of part 4 of `device_check.py` (the 8B-shaped decode roofline) between two trees of this repository,
processes alternating on one machine: the figures of one device run vary by process (run 9 on an H100: two
clusters 9% apart at batch 1), so a change is judged by the medians of many processes of each side.

    git worktree add base <commit>      # or an archive of it: the base tree travels with the working tree
    python benchmarks/device_ab.py --base base --pairs 4 --batches 1,32 --json out/ab.json

Each process: ``python benchmarks/device_check.py --parts 4 --batches B --no-profile`` run in its tree (base, then
this one, `--pairs` times); extra device_check options follow ``--``. Prints a table per batch (every process's
tok/s, the median, the median fraction of the roofline) and writes every process's rows to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run_one(tree: Path, batches: str, extra: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "benchmarks/device_check.py", "--parts", "4", "--batches", batches, "--no-profile",
               "--out", out, *extra]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        seconds = time.perf_counter() - start
        report = Path(out) / "device_check.json"
        part = json.loads(report.read_text())["parts"].get("4 8B-shaped roofline", {}) if report.exists() else {}
        return {"rows": part.get("rows", []), "ok": proc.returncode == 0 and bool(part.get("rows")),
                "seconds": round(seconds, 1), "error": part.get("error") or (proc.stderr[-2000:] if proc.returncode
                                                                             else None)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the other tree (a checkout of the base commit)")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--timeout", type=float, default=120, help="seconds a process may take")
    p.add_argument("--json")
    args = p.parse_args(argv)
    trees = {"base": Path(args.base).resolve(), "this": HERE}
    processes = []
    for pair in range(args.pairs):
        for side, tree in trees.items():
            result = run_one(tree, args.batches, extra, args.timeout) | {"side": side, "pair": pair}
            processes.append(result)
            rates = {r["batch"]: round(r["decode_tok_s"], 1) for r in result["rows"]}
            print(f"pair {pair} {side}: {rates if result['ok'] else result['error']} ({result['seconds']} s)",
                  flush=True)
    summary = []
    for batch in (int(b) for b in args.batches.split(",")):
        for side in trees:
            rows = [r for q in processes if q["side"] == side for r in q["rows"] if r["batch"] == batch]
            if rows:
                rates = sorted(r["decode_tok_s"] for r in rows)
                fractions = [r["decode_fraction"] for r in rows if "decode_fraction" in r]  # none off a GPU/TPU
                summary.append({"batch": batch, "side": side, "processes": len(rows), "tok_s": rates,
                                "median_tok_s": statistics.median(rates),
                                "median_fraction": statistics.median(fractions) if fractions else None})
    print("| batch | tree | processes | tok/s, every process | median | median of the roofline |")
    print("|---|---|---|---|---|---|")
    for s in summary:
        fraction = "-" if s["median_fraction"] is None else f"{100 * s['median_fraction']:.1f}%"
        print(f"| {s['batch']} | {s['side']} | {s['processes']} | {', '.join(f'{x:.1f}' for x in s['tok_s'])} | "
              f"{s['median_tok_s']:.1f} | {fraction} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"base": str(trees["base"]), "batches": args.batches, "extra": extra,
                                               "processes": processes, "summary": summary}, indent=1))
    return 0 if all(q["ok"] for q in processes) else 1


if __name__ == "__main__":
    sys.exit(main())
