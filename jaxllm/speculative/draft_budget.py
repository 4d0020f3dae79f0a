"""Which of the proposed drafts a step verifies. A draft costs a row of the step whether the target keeps it or
not. Where a step's time barely grows with its rows (a GPU's small batches: reading the weights is the step),
every draft is nearly free; where it grows about linearly past a few rows (a CPU: a 16-row step of SmolLM2 costs
2-4 one-row steps), a batch's drafts that will likely be rejected make it slower than plain decoding.

Each step the budget keeps the drafts that make the most expected tokens per second of the step: the decoding
sequences' own tokens plus, for each kept draft, the chance the target keeps it (a sequence's i-th draft is kept
when its first i are: ``rate ** i``, rate its estimated chance of keeping one draft given the one before), over
the step's time in the bucket it would run in. Each bucket is timed at warm-up (`ModelRunner.warmup`: an empty
step, which neither attends nor samples) and then by the steps the engine runs with none other in flight (a
moving average: a real step's attention and sampled rows, at the contexts being served). A drafted step also
waits for the host's work around it (proposing from the last tokens, scheduling, reading back), which a step
without drafts hides by running ahead (async scheduling): that time, measured too, counts against drafts. A sequence
keeps a prefix of its drafts; the others are dropped before the scheduler counts them. Which drafts run never
changes a token (the target samples each position with the key a plain step would use: `verify`), only speed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

PRIOR_WEIGHT = 2.0  # drafts' worth of the pooled rate in a sequence's own estimate (Laplace-style smoothing)
FRESH_RATE = 0.5  # the pooled rate's own prior, before any draft was judged
STEP_WEIGHT = 0.25  # a timed step's weight in its bucket's moving average
PROBE_EVERY = 32  # after so many steps whose drafts were all dropped, one runs its likeliest draft: the estimates
# learn only from drafted steps, and must not freeze on an early bad run


@dataclasses.dataclass
class KeepRate:
    """Drafts a source tried (positions the target judged: each kept draft, and the first rejected one) and kept."""
    tried: float = 0.0
    kept: float = 0.0

    def observe(self, drafted: int, kept: int) -> None:
        self.tried += kept + (kept < drafted)
        self.kept += kept

    def estimate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.kept + weight * prior) / (self.tried + weight)


def choose(lengths: list[int], rates: list[float], step_seconds: Callable[[int], float]) -> list[int]:
    """How many of its drafts each decoding sequence keeps: `lengths` proposed, `rates` the chance of keeping one
    draft given the one before, `step_seconds(tokens)` a step's time with so many tokens (inf: no bucket holds
    it). The kept drafts are the likeliest first (a sequence's are less likely the later they come, so each keeps
    a prefix), as many as maximise expected tokens per second; no drafts when none helps."""
    n = len(lengths)
    candidates = sorted(((rates[s] ** i, i, s) for s in range(n) for i in range(1, lengths[s] + 1)),
                        key=lambda c: (-c[0], c[1], c[2]))
    best_rate, best_count = n / step_seconds(n), 0
    expected = float(n)
    for count, (value, _, _) in enumerate(candidates, start=1):
        expected += value
        rate = expected / step_seconds(n + count)
        if rate > best_rate:
            best_rate, best_count = rate, count
    kept = [0] * n
    for _, _, s in candidates[:best_count]:
        kept[s] += 1
    return kept


class DraftBudget:
    """The step-time estimates and the per-step choice (`choose`) of `draft_budget="step_cost"`."""

    def __init__(self, bucket_seconds: dict[tuple[int, int], float], bucket_for: Callable[[int, int], tuple[int, int]],
                 overlap: bool = True):
        """bucket_seconds: a step's time in each (tokens, sequences) bucket; bucket_for: the bucket a step of so
        many tokens and sequences runs in (ValueError: none); overlap: a step without drafts runs ahead of the
        host's work (async scheduling), so only a drafted step pays for that work (`host_seconds`)."""
        self.bucket_seconds, self.bucket_for, self.overlap = bucket_seconds, bucket_for, overlap
        self.host_seconds = 0.0  # the host's work around a drafted step: proposing, scheduling, reading back
        self.dropped = 0  # steps in a row whose proposals were all dropped
        self.probe_owed = False  # a draft is owed to the estimates (`PROBE_EVERY`)

    def observe(self, bucket: tuple[int, int], seconds: float, host_seconds: float | None = None) -> None:
        """A step of `bucket` took `seconds` from its dispatch to its result, and `host_seconds` more around it
        (a drafted step's, which no step overlapped)."""
        old = self.bucket_seconds.get(bucket)
        self.bucket_seconds[bucket] = seconds if old is None else old + STEP_WEIGHT * (seconds - old)
        if host_seconds is not None:
            self.host_seconds += STEP_WEIGHT * (host_seconds - self.host_seconds)
            self.dropped, self.probe_owed = 0, False

    def step_seconds(self, tokens: int, seqs: int) -> float:
        try:
            return self.bucket_seconds.get(self.bucket_for(tokens, seqs), float("inf"))
        except ValueError:
            return float("inf")

    def trim(self, lengths: list[int], rates: list[float]) -> list[int]:
        """`choose` for a step whose decoding sequences proposed `lengths` drafts."""
        n = len(lengths)
        host = self.host_seconds if self.overlap else 0.0
        kept = choose(lengths, rates, lambda tokens: self.step_seconds(tokens, n) + (host if tokens > n else 0.0))
        if any(kept) or not any(lengths):
            self.dropped = 0
            return kept
        if not self.probe_owed:
            self.dropped += 1
            self.probe_owed = self.dropped >= PROBE_EVERY
        if self.probe_owed:  # until a drafted step is timed (`observe`)
            kept[max((s for s in range(n) if lengths[s]), key=rates.__getitem__)] = 1
        return kept
