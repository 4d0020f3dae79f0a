"""The draft budget: which proposed drafts a step verifies, by expected tokens per second of the step."""

import math

import pytest

from jaxllm.engine.scheduler import ScheduledStep
from jaxllm.sampling_params import SamplingParams
from jaxllm.speculative.draft_budget import DraftBudget, KeepRate, choose
from tests.speculative.test_drafter import decoding, drafter


def linear(fixed: float, per_token: float):
    return lambda tokens: fixed + per_token * tokens


def test_a_step_whose_time_is_flat_verifies_every_draft():
    assert choose([4, 2, 0], [0.3, 0.1, 0.9], linear(1.0, 0.0)) == [4, 2, 0]


def test_a_lone_sequence_drafts_while_a_draft_pays_for_its_row():
    # a row costs a fifth of a one-row step: the i-th draft pays while the tokens a second still rise
    kept = choose([7], [0.9], linear(4.0, 1.0))
    assert kept == [7]
    assert choose([7], [0.1], linear(4.0, 1.0)) == [0]  # 0.1 < 1 / 5: not even the first
    got = choose([7], [0.6], linear(4.0, 1.0))[0]
    rate = [(1 + sum(0.6 ** i for i in range(1, d + 1))) / (5 + d) for d in range(8)]
    assert got == max(range(8), key=rate.__getitem__) and 0 < got < 7


def test_a_large_batch_on_a_row_bound_step_keeps_only_likely_drafts():
    # 16 decoding sequences, a step of T rows costing 4 + T: a draft must be kept with chance > 16 / 20
    rates = [0.99] * 4 + [0.5] * 12
    kept = choose([3] * 16, rates, linear(4.0, 1.0))
    assert all(k == 0 for k in kept[4:])  # the unlikely drafts go
    assert all(k > 0 for k in kept[:4])  # the nearly certain ones stay


def test_each_sequence_keeps_a_prefix_and_the_likeliest_go_first():
    # room for exactly 3 drafts before the cost jumps: the sequence with the best rate gets them in order
    def cost(tokens):
        return 1.0 if tokens <= 5 else 100.0
    assert choose([4, 4], [0.5, 0.9], cost) == [0, 3]


def test_tokens_past_every_bucket_are_never_chosen():
    buckets = [(4, 4), (8, 8)]

    def bucket_for(tokens, seqs):
        for b in buckets:
            if b[0] >= tokens and b[1] >= seqs:
                return b
        raise ValueError("no bucket")
    budget = DraftBudget(dict.fromkeys(buckets, 1.0), bucket_for)
    assert budget.step_seconds(9, 2) == math.inf
    assert budget.trim([5, 5], [1.0, 1.0]) == [3, 3]  # 2 + 6 rows fill the largest bucket, in turns


def test_keep_rate_counts_the_positions_judged():
    r = KeepRate()
    r.observe(drafted=4, kept=4)  # four judged, four kept
    r.observe(drafted=4, kept=1)  # the second rejected: two judged
    assert (r.tried, r.kept) == (6, 5)
    assert r.estimate(prior=0.5, weight=2) == pytest.approx((5 + 1) / 8)
    assert KeepRate().estimate(prior=0.3) == pytest.approx(0.3)


def test_the_drafter_trims_by_the_calibrated_step_times():
    d = drafter(k=4, draft_budget="step_cost")
    seqs = [decoding(SamplingParams()) for _ in range(16)]
    for i, s in enumerate(seqs):
        s.seq_id = i
    d.propose(seqs)
    assert all(len(s.drafts) == 4 for s in seqs)  # not calibrated: every proposal stands
    buckets = [(t, 16) for t in range(16, 97, 8)]
    d.calibrate({b: 4.0 + b[0] for b in buckets}, lambda t, s: next(b for b in buckets if b[0] >= t))
    d.propose(seqs)  # no history: the pooled prior (1/2) is far below 16 / 20
    assert all(s.drafts == [] for s in seqs)
    for i, s in enumerate(seqs):  # two sequences that kept every draft, many times; the others, none
        for _ in range(20):
            d.observe(ScheduledStep([s], [5], drafts=[[4, 5, 6, 7]]), rejected=[0 if i < 2 else 4])
    d.caps.clear()
    d.propose(seqs)
    assert [len(s.drafts) for s in seqs[:2]] == [4, 4] and all(s.drafts == [] for s in seqs[2:])


def test_all_the_default_keeps_every_draft_even_when_calibrated():
    d = drafter(k=4)
    d.calibrate({(16, 16): 1.0, (96, 16): 100.0}, lambda t, s: (16, 16) if t <= 16 else (96, 16))
    seqs = [decoding(SamplingParams()) for _ in range(16)]
    d.propose(seqs)
    assert d.budget is None and all(len(s.drafts) == 4 for s in seqs)


def test_a_step_does_not_wait_for_tokens_whose_drafts_the_budget_would_drop():
    """Async scheduling runs a step ahead unless some sequence quotes; it also runs ahead when the drafts the
    quoting sequences would get cost more than they save."""
    d = drafter(k=4, draft_budget="step_cost")
    seqs = []
    for i in range(16):
        s = decoding(SamplingParams())
        s.num_prompt_tokens = len(s.token_ids) - 1  # "3" is its first output token: the lookup would have said it
        s.seq_id = i
        seqs.append(s)
    assert d.worth_waiting(seqs)
    buckets = [(t, 16) for t in range(16, 97, 8)]
    d.calibrate({b: 4.0 + b[0] for b in buckets}, lambda t, s: next(b for b in buckets if b[0] >= t))
    assert not d.worth_waiting(seqs)  # no history: the pooled prior is far below what a row costs here
    d.calibrate({b: 1.0 for b in buckets}, lambda t, s: next(b for b in buckets if b[0] >= t))
    assert d.worth_waiting(seqs)  # rows that cost nothing: drafts pay


def test_a_buckets_estimate_follows_the_steps_timed():
    budget = DraftBudget({(8, 8): 1.0}, lambda t, s: (8, 8))
    for _ in range(40):
        budget.observe((8, 8), 3.0)
    assert budget.step_seconds(8, 1) == pytest.approx(3.0, rel=1e-3)
    budget.observe((8, 8), 7.0)
    assert 3.0 < budget.step_seconds(8, 1) < 7.0  # one step moves it, not all the way


def test_the_hosts_work_around_a_drafted_step_counts_against_its_drafts():
    """A step without drafts runs ahead of the host's work (async scheduling); a drafted one waits for it."""
    budget = DraftBudget({(1, 1): 1.0, (8, 8): 1.0}, lambda t, s: (1, 1) if t == 1 else (8, 8))
    assert budget.trim([7], [0.5]) == [7]  # rows that cost nothing
    budget.observe((8, 8), 1.0, host_seconds=3.0)
    budget.observe((8, 8), 1.0, host_seconds=3.0)
    assert budget.host_seconds > 1.0
    assert budget.trim([7], [0.5]) == [0]  # < 1 token expected from the drafts, for more than twice the time
    assert budget.trim([7], [0.99]) == [7]
    assert DraftBudget(budget.bucket_seconds, budget.bucket_for, overlap=False).trim([7], [0.5]) == [7]


def test_a_budget_that_drops_every_draft_probes_now_and_then():
    from jaxllm.speculative.draft_budget import PROBE_EVERY

    budget = DraftBudget({(1, 1): 1.0, (8, 8): 100.0}, lambda t, s: (1, 1) if t == 1 else (8, 8))
    got = [budget.trim([7], [0.5]) for _ in range(PROBE_EVERY + 2)]
    assert got[:PROBE_EVERY - 1] == [[0]] * (PROBE_EVERY - 1)
    assert got[PROBE_EVERY - 1:] == [[1]] * 3  # one draft, asked until a drafted step is timed
    budget.observe((8, 8), 100.0, host_seconds=0.1)
    assert budget.trim([7], [0.5]) == [0]
