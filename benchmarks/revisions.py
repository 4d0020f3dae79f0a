"""The same workload on two revisions of jaxllm, alternating, each run in its own process: a refactor's "same
speed" in one sitting (`offline.py`'s jaxllm run: batched 32 x (128 + 128) and a single stream, the `smollm2-cpu`
preset). Each revision is checked out in a temporary git worktree and imported from there.

    python benchmarks/revisions.py BEFORE [AFTER (default: the working tree)] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import machine

ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, str(tree / "benchmarks" / "offline.py"), "--engine", "jaxllm", "--json",
                        out.name], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before")
    p.add_argument("after", nargs="?", help="a revision (default: the working tree as it is)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for name, rev in (("before", args.before), ("after", args.after)):
            if rev is None:
                trees[name] = ROOT
                continue
            trees[name] = Path(tmp) / name
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(trees[name]), rev],
                           check=True)
        labels = {"before": args.before, "after": args.after or "working tree"}
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        try:
            for r in range(args.rounds):
                for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    runs[name].append(run(trees[name]))
                    print(f"round {r}: {labels[name]} {runs[name][-1]}", flush=True)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    summary = {labels[k]: {m: statistics.median(x[m] for x in rs) for m in ("batch_tok_s", "single_tok_s")}
               for k, rs in runs.items()}
    host = machine.describe()
    print(f"\nmedians over {args.rounds} rounds\n{machine.line(host)}")
    for k, m in summary.items():
        print(f"{k:24s} batch 32 {m['batch_tok_s']:8.1f} tok/s   single {m['single_tok_s']:7.1f} tok/s")
    a, b = summary[labels["after"]], summary[labels["before"]]
    ratios = {m: a[m] / b[m] for m in ("batch_tok_s", "single_tok_s")}
    print(f"after / before: batch {ratios['batch_tok_s']:.3f}, single {ratios['single_tok_s']:.3f}")
    machine.save(args.json, host, rounds=args.rounds, summary=summary, ratios=ratios, runs=runs)


if __name__ == "__main__":
    main()
