"""Which sequences draft, and how many drafts each gets: room left, a cap that follows what was kept."""

from jaxllm.engine.scheduler import ScheduledStep
from jaxllm.engine.sequence import Request, Sequence
from jaxllm.sampling_params import SamplingParams
from jaxllm.speculative import Drafter, SpeculativeConfig
from jaxllm.speculative.drafter import GUESS_AFTER

QUOTED = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3]  # "1 2 3" seen before: 4 5 6 ... follow


def decoding(params: SamplingParams, tokens=QUOTED) -> Sequence:
    seq = Sequence(Request("r", None, tokens, params, seed=0), 0, None)
    seq.num_computed_tokens = len(tokens) - 1  # the last token's KV is not computed yet: it decodes
    return seq


def drafter(k=4, **fields) -> Drafter:
    return Drafter(SpeculativeConfig("ngram", num_speculative_tokens=k, prompt_lookup_max=3, **fields),
                   max_model_len=64)


def test_room_left_and_what_may_not_draft():
    d = drafter()
    free, short, last, long_ctx = (decoding(SamplingParams(max_tokens=100)), decoding(SamplingParams(max_tokens=2)),
                                   decoding(SamplingParams(max_tokens=1)),
                                   decoding(SamplingParams(), QUOTED + [0] * 45 + [1, 2, 3]))
    no = [decoding(SamplingParams(presence_penalty=0.5)), decoding(SamplingParams(min_tokens=5)),
          decoding(SamplingParams(structured_outputs={"choice": ["a"]}))]
    no[2].matcher = object()  # the engine gives a constrained sequence its grammar's matcher
    d.propose([free, short, last, long_ctx, *no])
    assert free.drafts == [4, 5, 6, 7]
    assert short.drafts == [4] and last.drafts == []  # a kept draft is an output token, and the target adds one
    assert len(long_ctx.token_ids) == 63 and long_ctx.drafts == []  # no room left in max_model_len 64
    assert all(s.drafts == [] for s in no)


def test_the_cap_follows_what_was_kept():
    d = drafter(k=4)
    seq = decoding(SamplingParams())
    d.propose([seq])
    assert len(seq.drafts) == 4
    d.observe(ScheduledStep([seq], [5], drafts=[seq.drafts]), rejected=[3])  # kept 1 of 4
    d.propose([seq])
    assert len(seq.drafts) == 2  # 2 x kept
    d.observe(ScheduledStep([seq], [3], drafts=[seq.drafts]), rejected=[2])  # kept none
    d.propose([seq])
    assert len(seq.drafts) == 1  # still probes with one
    d.observe(ScheduledStep([seq], [2], drafts=[seq.drafts]), rejected=[0])  # all kept: k again
    d.propose([seq])
    assert len(seq.drafts) == 4
    assert d.stats.num_drafts == 3 and d.stats.num_accepted_tokens == 2
    d.propose([])
    assert d.caps == {}  # sequences that left are forgotten


def test_a_quoting_sequence_waits_for_its_probe_whatever_its_cap():
    """With async scheduling a step runs ahead (without drafts) unless some sequence is worth waiting for: one
    whose cap fell to 1 must still be, while it quotes, or it would never draft again."""
    d = drafter(k=4)
    seq, fresh = decoding(SamplingParams(), QUOTED[:-2]), decoding(SamplingParams(), [5, 6, 7, 8, 9])
    for s, out in ((seq, QUOTED[-2:]), (fresh, [1, 2])):  # output tokens: the prompt's "1 2 3" quoted, or not
        s.token_ids.extend(out)
        s.num_computed_tokens += len(out)
    d.propose([seq, fresh])
    d.observe(ScheduledStep([seq], [5], drafts=[seq.drafts]), rejected=[4])  # kept none: cap 1
    d.propose([seq, fresh])
    assert len(seq.drafts) == 1 and fresh.drafts == []
    assert d.worth_waiting([seq]) and not d.worth_waiting([fresh])  # quoting (its last token was predicted) or not
    short = decoding(SamplingParams(max_tokens=2), QUOTED[:-2])
    short.token_ids.extend(QUOTED[-2:])
    short.num_computed_tokens += 2
    assert d.worth_waiting([short]) is False  # room for no draft


def test_no_drafts_for_a_large_batch():
    d = drafter(disable_by_batch_size=2)
    seqs = [decoding(SamplingParams()), decoding(SamplingParams())]
    d.propose(seqs)
    assert all(s.drafts == [] for s in seqs)
    d.propose(seqs[:1])
    assert seqs[0].drafts == [4, 5, 6, 7]


def test_a_guess_is_the_step_after_all_drafts_kept():
    """`guess`: the tokens a drafted sequence gains if every draft is kept and the target adds the token the lookup
    expects, and the drafts `propose` would give it then; none where a guess is unlikely or has no room."""
    d = drafter(k=4)
    seq = decoding(SamplingParams(max_tokens=100))
    d.propose([seq])
    step = ScheduledStep([seq], [5], drafts=[seq.drafts])
    assert d.guess(step) is None  # its first drafts: nothing says it quotes yet
    d.observe(ScheduledStep([seq], [3], drafts=[[4, 5]]), rejected=[0])  # as if it had kept its drafts before
    assert d.guess(step) is None  # once: not yet
    d.observe(ScheduledStep([seq], [3], drafts=[[4, 5]]), rejected=[0])
    assert d.guess(step) == [([4, 5, 6, 7, 8], [9, 10, 11, 12])]
    longer = decoding(SamplingParams(max_tokens=100), QUOTED + [4, 5, 6, 7, 8])  # as if the guess held
    d.propose([longer])
    assert longer.drafts == [9, 10, 11, 12]

    assert d.guess(ScheduledStep([seq, seq], [5, 1], drafts=[seq.drafts, []])) is None  # one did not draft
    tight = decoding(SamplingParams(max_tokens=6))  # drafts 4..7 and the guess 8: 5 of 6 outputs, 1 more the target's
    d.streaks[tight.seq_id] = GUESS_AFTER
    d.propose([tight])
    assert tight.drafts == [4, 5, 6, 7] and d.guess(ScheduledStep([tight], [5], drafts=[tight.drafts])) is None
    ends = decoding(SamplingParams(max_tokens=100), [1, 2, 3, 4, 5, 6, 1, 2, 3])  # the quote wraps round
    d.streaks[ends.seq_id] = GUESS_AFTER
    d.propose([ends])
    assert ends.drafts == [4, 5, 6, 1] and d.guess(ScheduledStep([ends], [5], drafts=[ends.drafts])) == \
        [([4, 5, 6, 1, 2], [3, 4, 5, 6])]
    d.observe(ScheduledStep([ends], [5], drafts=[ends.drafts]), rejected=[2])  # kept 2 of 4
    d.propose([ends])
    assert ends.drafts and d.guess(ScheduledStep([ends], [1 + len(ends.drafts)], drafts=[ends.drafts])) is None


def test_no_guess_for_a_method_that_runs_a_model_or_with_the_draft_budget():
    seq = decoding(SamplingParams(max_tokens=100))
    d = drafter(k=4)
    d.proposer.propose_after = lambda seq, gained, n: None  # as a draft model's (`Proposer.propose_after`)
    d.streaks[seq.seq_id] = GUESS_AFTER
    d.propose([seq])
    assert seq.drafts and d.guess(ScheduledStep([seq], [5], drafts=[seq.drafts])) is None
    budget = drafter(k=4, draft_budget="step_cost")
    budget.calibrate({(8, 8): 1e-3}, lambda t, s: (8, 8))
    budget.streaks[seq.seq_id] = GUESS_AFTER
    budget.propose([seq])
    assert seq.drafts and budget.guess(ScheduledStep([seq], [1 + len(seq.drafts)], drafts=[seq.drafts])) is None
