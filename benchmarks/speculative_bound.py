"""How far prompt lookup (`ngram`) can take one request at a time on this host, with the embedded SmolLM2 and
`benchmarks/data/speculative_prompts.json`'s grounded prompts: where the speculative engine's time goes, and what
its speed would be if parts of that time were gone.

The plain and the ngram engine (`LLM()` defaults) answer each grounded prompt in turn, greedy, from an empty prefix
cache, while their step calls are traced. The traces give this host's costs: each prompt's prefill, the plain
engine's decode period (its steps run back to back: async scheduling hides the host), and the ngram engine's cost
of a step of each token bucket dispatched with no other in flight, split into the device's part and the reading
back, and the host's gap before such a step (verifying, proposing, scheduling, building the inputs). Then the
plain engine's answers (the ngram engine's are the same tokens, checked) are replayed through a model of the
engine's decode loop: the lookup of `jaxllm.speculative.ngram`, the drafter's caps, its "worth waiting" rule and
its guessed steps (`jaxllm.speculative.drafter`, `jaxllm.engine.llm_engine`), each step costed as traced. The
model's time is printed beside the measured one (how far to trust it), then under what-ifs: the host's work
hidden, a drafted step's extra rows at half their cost, and extra rows free (a step of 8 or 16 tokens costing a
1-token step: a device whose steps are bound by reading the weights), each against the plain engine's measured
time.

    python benchmarks/speculative_bound.py [--rounds 2] [--k 7] [--json out.json]

The model is a bound, not a benchmark: it counts whole steps and ignores what the traces do not show (a guessed
step's host work, the host's work overlapping a step in flight). `benchmarks/speculative.py` measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import machine
from speculative import MAX_TOKENS, conversations


@dataclasses.dataclass
class Costs:
    """A host's step costs in seconds: `device[T]` a step of bucket T's device time, `readback` reading a step
    back, `gap` the host's work before a step dispatched with none in flight, `period` the plain engine's decode
    step (back to back)."""
    device: dict[int, float]
    readback: float
    gap: float
    period: float

    def what_if(self, host: bool = True, rows: float = 1.0) -> Costs:
        """These costs with the host's work gone (host=False) and each bucket's cost past a 1-token step's scaled
        by `rows`."""
        base = self.device[1]
        device = {t: base + (c - base) * rows for t, c in self.device.items()}
        return Costs(device, self.readback if host else 0.0, self.gap if host else 0.0, self.period)

    def step(self, bucket: int) -> float:
        """A bucket's device time; one no traced step ran alone in: on the line through the nearest ones traced."""
        if bucket in self.device:
            return self.device[bucket]
        known = sorted(self.device)
        lo = max([t for t in known if t < bucket] or known[:1])
        hi = min([t for t in known if t > bucket and t != lo] or [t for t in known if t != lo][-1:] or [lo])
        if hi == lo:
            return self.device[lo]
        return self.device[lo] + (self.device[hi] - self.device[lo]) * (bucket - lo) / (hi - lo)


class Tracer:
    """Records a runner's step calls: per step its token count, bucket, whether another step was in flight when it
    was dispatched, when its dispatch returned and when its collect returned."""

    def __init__(self, runner):
        self.steps: list[dict] = []
        self._open: dict[int, dict] = {}
        dispatch, collect = runner.dispatch, runner.collect

        def traced_dispatch(step, *args, **kwargs):
            alone = not self._open
            pending = dispatch(step, *args, **kwargs)
            record = {"tokens": step.num_tokens, "bucket": pending.bucket[0], "alone": alone,
                      "dispatched": time.perf_counter()}
            self._open[id(pending)] = record
            self.steps.append(record)
            return pending

        def traced_collect(pending):
            result = collect(pending)
            self._open.pop(id(pending))["collected"] = time.perf_counter()
            return result
        runner.dispatch, runner.collect = traced_dispatch, traced_collect

    def take(self) -> list[dict]:
        steps, self.steps = self.steps, []
        return [s for s in steps if "collected" in s]  # a dropped guessed step is never collected


def measure(rounds: int, spec: dict) -> tuple[list[dict], Costs, object]:
    """Both engines on every grounded prompt, `rounds` times; per prompt its measured times and answer, and the
    ngram engine's costs (medians over all traced steps)."""
    from jaxllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    engines = {"plain": LLM(), "ngram": LLM(speculative_config=spec)}
    tracers = {name: Tracer(llm.engine.runner) for name, llm in engines.items()}
    convs = conversations()["grounded"]
    for llm in engines.values():
        llm.chat(convs[:1], params, use_tqdm=False)
    for tracer in tracers.values():
        tracer.take()
    prompts = [{"plain": [], "ngram": [], "fixed": []} for _ in convs]
    alone: dict[int, list[float]] = {}
    gaps, periods = [], []
    for r in range(rounds):
        for i, conv in enumerate(convs):
            for name in (("plain", "ngram") if (r + i) % 2 == 0 else ("ngram", "plain")):
                llm = engines[name]
                llm.reset_prefix_cache()
                start = time.perf_counter()
                out = llm.chat([conv], params, use_tqdm=False)[0]
                took = time.perf_counter() - start
                prompts[i][name].append(took)
                prompts[i]["prompt"], answer = out.prompt_token_ids, list(out.outputs[0].token_ids)
                if prompts[i].setdefault(f"answer_{name}", answer) != answer:
                    raise RuntimeError(f"prompt {i}: the {name} engine's answer changed between rounds")
                steps = tracers[name].take()
                prefill, decode = steps[0], steps[1:]
                if name == "plain":  # all but the decode loop: the prefill, and the request's own work
                    prompts[i]["fixed"].append(took - (steps[-1]["collected"] - prefill["collected"]))
                    periods += [b["collected"] - a["collected"] for a, b in zip(decode, decode[1:], strict=False)]
                    continue
                for before, step in zip(steps, decode, strict=False):
                    if step["alone"]:
                        alone.setdefault(step["bucket"], []).append(step["collected"] - step["dispatched"])
                        gaps.append(step["dispatched"] - before["collected"])
    for i, p in enumerate(prompts):
        if p["answer_plain"] != p["answer_ngram"]:
            raise RuntimeError(f"prompt {i}: speculation changed the greedy answer")
    period = statistics.median(periods)
    cost = {t: statistics.median(v) for t, v in alone.items()}
    readback = max(0.0, cost[1] - period)  # a lone 1-token step against the back-to-back period
    costs = Costs({t: c - readback for t, c in sorted(cost.items())}, readback, statistics.median(gaps), period)
    return prompts, costs, engines["ngram"]


def replay(prompt: list[int], answer: list[int], engine, costs: Costs) -> tuple[float, int]:
    """The ngram engine's decode of `answer` after `prompt`'s prefill, modelled step by step (one sequence):
    seconds and steps. Mirrors `LLMEngine.step`: a step with no drafts has its successor dispatched ahead unless
    the sequence is quoting (`Drafter.worth_waiting`); a drafted one has its successor dispatched on a guess after
    `GUESS_AFTER` drafted steps that kept every draft (`Drafter.guess`), dropped (its device time spent) unless
    the guess holds; any other step waits for the host's gap."""
    from jaxllm.speculative.drafter import GUESS_AFTER

    drafter = engine.engine.drafter
    lookup, k = drafter.proposer.lookup, drafter.config.num_speculative_tokens
    bucket = engine.engine.runner.bucket_for
    n = len(answer)

    def room(h: int, gained: int = 0, cap: int | None = None) -> int:  # `Drafter._room` for max_tokens
        return min(k if cap is None else cap, MAX_TOKENS - h - gained - 1)

    def run(start: float, tokens: int) -> float:
        nonlocal free
        free = max(start, free) + costs.step(bucket(tokens, 1)[0])
        return free

    def kept(h: int, drafts: list[int]) -> int:  # the drafts the target keeps: those the answer has next
        m = 0
        while m < len(drafts) and h + m < n and drafts[m] == answer[h + m]:
            m += 1
        return m

    t = free = 0.0
    h, streak, steps = 1, 0, 0  # the prefill step sampled the first token
    cap = k
    ahead = None  # (drafts, end, tokens the guess assumed or None)
    while h < n:
        if ahead is not None:
            (drafts, end, _), ahead = ahead, None
        else:
            t += costs.gap
            drafts = lookup(prompt + answer[:h], room(h, cap=cap))
            end = run(t, 1 + len(drafts))
        steps += 1
        tokens = prompt + answer[:h]
        if not drafts:
            quoting = room(h) > 1 and lookup(tokens[:-1], 1) == tokens[-1:]
            if not quoting and h + 1 < MAX_TOKENS:
                ahead = ([], run(t, 1), None)
        elif streak >= GUESS_AFTER and (guess := lookup(tokens + drafts, 1)):
            gained = drafts + guess
            after = lookup(tokens + gained, room(h, len(gained))) if room(h, len(gained)) > 0 else []
            if after:
                ahead = (after, run(t, 1 + len(after)), gained)
        t = max(t, end) + costs.readback
        got = kept(h, drafts)
        if drafts:
            lost = len(drafts) - got
            cap = k if lost == 0 else max(1, 2 * got)
            streak = streak + 1 if lost == 0 else 0
        if ahead is not None and ahead[2] is not None and answer[h:h + got + 1] != ahead[2]:
            ahead = None  # a failed guess: dropped
        h += got + 1
    return t, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    prompts, costs, engine = measure(args.rounds, spec)
    host = machine.describe()
    print(f"{machine.line(host)}\nngram: {spec}")
    print(f"costs (ms): plain decode period {costs.period * 1e3:.2f}; host gap before a waited step "
          f"{costs.gap * 1e3:.2f}; reading a step back {costs.readback * 1e3:.2f}; device time by token bucket "
          + ", ".join(f"{t}: {c * 1e3:.2f}" for t, c in costs.device.items()))
    scenarios = {"model": costs, "host hidden": costs.what_if(host=False),
                 "host hidden, extra rows at half cost": costs.what_if(host=False, rows=0.5),
                 "host hidden, extra rows free": costs.what_if(host=False, rows=0.0)}
    plain = [statistics.median(x["plain"]) for x in prompts]
    measured = [statistics.median(x["ngram"]) for x in prompts]
    fixed = [statistics.median(x["fixed"]) for x in prompts]
    modelled = {name: [pf + replay(x["prompt"], x["answer_plain"], engine, c)[0]
                       for x, pf in zip(prompts, fixed, strict=True)] for name, c in scenarios.items()}
    print(f"\n{'prompt':>6s} {'tokens':>6s} {'fixed ms':>10s} {'plain ms':>9s} {'ngram ms':>9s} {'model ms':>9s}"
          f" {'steps':>5s}")
    for i, x in enumerate(prompts):
        steps = replay(x["prompt"], x["answer_plain"], engine, costs)[1]
        print(f"{i:6d} {len(x['answer_plain']):6d} {fixed[i] * 1e3:10.1f} {plain[i] * 1e3:9.1f} "
              f"{measured[i] * 1e3:9.1f} {modelled['model'][i] * 1e3:9.1f} {steps:5d}")
    ratios = {"measured": sum(plain) / sum(measured)} | {name: sum(plain) / sum(m) for name, m in modelled.items()}
    print("\ngrounded prompts one at a time, the plain engine's measured time over the ngram engine's:")
    for name, ratio in ratios.items():
        per = plain if name == "measured" else None
        each = [a / b for a, b in zip(plain, measured if per else modelled[name], strict=True)]
        print(f"  {name:38s} {ratio:5.2f}x   per prompt " + " ".join(f"{x:.2f}" for x in each))
    machine.save(args.json, host, rounds=args.rounds, speculative_config=spec,
                 costs_ms={"period": costs.period * 1e3, "gap": costs.gap * 1e3, "readback": costs.readback * 1e3,
                           "device": {str(t): c * 1e3 for t, c in costs.device.items()}},
                 ratios=ratios, prompts=[{"tokens": len(x["answer_plain"]), "fixed_s": pf, "plain_s": a,
                                          "ngram_s": b, "model_s": m}
                                         for x, pf, a, b, m in zip(prompts, fixed, plain, measured,
                                                                   modelled["model"], strict=True)])


if __name__ == "__main__":
    main()
