"""Which sequences draft, and how many drafts each gets: room left, a cap that follows what was kept."""

from jaxllm.engine.scheduler import ScheduledStep
from jaxllm.engine.sequence import Request, Sequence
from jaxllm.sampling_params import SamplingParams
from jaxllm.speculative import Drafter, SpeculativeConfig

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


def test_no_drafts_for_a_large_batch():
    d = drafter(disable_by_batch_size=2)
    seqs = [decoding(SamplingParams()), decoding(SamplingParams())]
    d.propose(seqs)
    assert all(s.drafts == [] for s in seqs)
    d.propose(seqs[:1])
    assert seqs[0].drafts == [4, 5, 6, 7]
