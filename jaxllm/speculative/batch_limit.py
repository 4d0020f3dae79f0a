"""The batch size from which a step runs without drafts when `disable_by_batch_size` is "auto" (the default),
read from the target's own steps at warm-up.

A draft costs a row of the step whether the target keeps it or not. Where a step's time barely grows with its rows
(a device bound by reading the weights: a GPU's small batches, inferred; not run on one yet), drafting every
sequence costs little more than the plain step, and pays whatever the batch. Where it grows about linearly past a
few rows (a CPU, or any host once its batch is compute-bound), a batch of S sequences that each draft k tokens runs
S (1 + k) rows: that step pays only when its sequences keep enough drafts to make up for the extra rows. "auto"
turns drafts off from the smallest batch (S = 1, 2, 4, ... up to `MAX_PROBED_SEQS`) whose fully drafted step costs
more than (1 + k) / 2 of its plain steps: from there on, drafting would lose unless the batch kept more than about
half of its drafts. No such batch (or no bucket holding its drafted step): never, vLLM's default (None).

Each batch size is probed with real steps of that many sequences decoding at `CONTEXT` tokens, so the attention
and the LM head's rows, which grow with a drafted step's rows, are counted: the plain step timed back to back (as
async scheduling runs decode steps, the host's work hidden), the drafted one read back before the next (as a
drafted step waits for its tokens). The probes' sequences exist only for those steps: their K/V lands in free pages
that nothing has registered, and every real step writes its own K/V before reading it.

Why it matters on this kind of host: with 16 grounded streams on a 2-core CPU, drafting in the crowded steps made
them several times slower for the few tokens the batch's quoting sequences gained, and the run ended no sooner (its
longest answer sets its length); with the limit, the crowded steps run plain and the last streams draft
(`python benchmarks/speculative.py`; figures in docs/performance.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxllm.engine.model_runner import ModelRunner
    from jaxllm.engine.scheduler import ScheduledStep

MAX_PROBED_SEQS = 16  # the largest batch probed (a larger one costs start-up time)
CONTEXT = 256  # tokens each probe's sequences attend (fewer in a shorter model)


def probe_step(num_seqs: int, drafts: int, context: int, page_size: int, num_pages: int) -> ScheduledStep:
    """`num_seqs` greedy sequences decoding their token at position `context - 1` with `drafts` drafts each, each
    on its own pages from page 0 (all on the same pages when the cache has too few)."""
    from jaxllm.engine.scheduler import ScheduledStep
    from jaxllm.engine.sequence import Request, Sequence
    from jaxllm.sampling_params import SamplingParams

    pages = -(-(context + drafts) // page_size)
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(Request(f"probe-{i}", None, [0] * context, SamplingParams(temperature=0), seed=0), 0, None)
        seq.num_computed_tokens = context - 1
        first = i * pages if num_seqs * pages <= num_pages else 0
        seq.block_table = list(range(first, first + pages))
        seqs.append(seq)
    return ScheduledStep(seqs, [1 + drafts] * num_seqs, drafts=[[0] * drafts for _ in seqs])


def measure(runner: ModelRunner, k: int, max_num_seqs: int, max_model_len: int, page_size: int,
            num_pages: int) -> list[tuple[int, float, float]]:
    """(S, seconds of a plain step of S sequences back to back, of their fully drafted step) for S = 1, 2, 4, ...
    up to min(max_num_seqs, MAX_PROBED_SEQS) while a bucket holds the drafted step; none where the cache cannot
    hold one probe sequence (its pages are the cache's first ones)."""
    context = min(CONTEXT, max_model_len - k - 1, num_pages * page_size - k)
    if context < 2:
        return []
    out = []
    seqs = 1
    while seqs <= min(max_num_seqs, MAX_PROBED_SEQS):
        try:
            runner.bucket_for(seqs * (1 + k), seqs)
        except ValueError:  # no bucket holds the drafted step: the scheduler would cut its drafts anyway
            break
        plain = runner.time_step(probe_step(seqs, 0, context, page_size, num_pages), back_to_back=True)
        drafted = runner.time_step(probe_step(seqs, k, context, page_size, num_pages))
        out.append((seqs, plain, drafted))
        seqs *= 2
    return out


def resolve(k: int, measured: list[tuple[int, float, float]]) -> int | None:
    """The smallest measured batch size whose drafted step costs more than (1 + k) / 2 of its plain steps, or
    None."""
    for seqs, plain, drafted in measured:
        if drafted > (1 + k) / 2 * plain:
            return seqs
    return None
