"""Prompt lookup: the sequence's latest earlier occurrence of its last n tokens (longest n first) proposes what
followed it."""

import numpy as np
import pytest

from jaxllm.engine.sequence import Request, Sequence
from jaxllm.sampling_params import SamplingParams
from jaxllm.speculative import SpeculativeConfig
from jaxllm.speculative.ngram import NgramProposer


def proposer(k=4, n_max=3, n_min=1):
    return NgramProposer(SpeculativeConfig("ngram", num_speculative_tokens=k, prompt_lookup_max=n_max,
                                           prompt_lookup_min=n_min))


def test_the_longest_suffix_found_earlier_proposes_what_followed_it():
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0: [4, 5, 6, 9] followed (the later [2, 3] at 7 is a shorter match)
    assert proposer().lookup(tokens, 4) == [4, 5, 6, 9]
    assert proposer(k=2).lookup(tokens, 4) == [4, 5]
    assert proposer().lookup(tokens, 1) == [4]  # room left in the sequence caps it
    assert proposer().lookup(tokens, 0) == []


def test_the_latest_occurrence_wins_and_shorter_suffixes_are_tried():
    assert proposer().lookup([5, 1, 6, 5, 1, 7, 8, 5, 1], 4) == [7, 8, 5, 1]  # [5, 1] at 3 is later than at 0
    assert proposer(n_max=3, n_min=2).lookup([4, 9, 9, 3, 9], 4) == []  # only a 1-token match: below n_min
    assert proposer(n_max=3, n_min=1).lookup([4, 9, 2, 3, 9], 4) == [2, 3, 9]


def test_nothing_to_propose():
    assert proposer().lookup([], 4) == []
    assert proposer().lookup([7], 4) == []
    assert proposer().lookup([1, 2, 3, 4], 4) == []  # no earlier occurrence of any suffix
    assert proposer().lookup([3, 3], 4) == [3]  # what follows the match is all there is


def reference_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The lookup as written first: every window of the tokens before the last compared with the suffix."""
    t = np.asarray(tokens, np.int64)
    if k <= 0 or len(t) < n_min + 1:
        return []
    for n in range(min(n_max, len(t) - 1), n_min - 1, -1):
        hits = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(t[:-1], n) == t[-n:]).all(axis=1))
        if hits.size:
            return t[hits[-1] + n:hits[-1] + n + k].tolist()
    return []


@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_the_lookup_is_every_windows_comparison(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(300):
        tokens = rng.integers(0, vocab, int(rng.integers(0, 40))).tolist()
        k, n_min = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 3))
        room = int(rng.integers(0, 8))  # the drafts a sequence has room for
        assert proposer(k, n_max, n_min).lookup(tokens, room) == reference_lookup(tokens, min(k, room), n_max, n_min)


def test_a_growing_sequence_is_looked_up_as_its_token_list():
    """A running sequence's tokens are kept as an array appended to as it grows: its proposals, guesses and
    "worth waiting" are those of its token list at every length, past the array's first capacity."""
    rng = np.random.default_rng(0)
    p = proposer(k=5, n_max=4, n_min=2)
    seq = Sequence(Request("r", None, rng.integers(0, 6, 30).tolist(), SamplingParams(), seed=0), 0, None)
    for _ in range(120):
        p.begin([seq])
        ids = list(seq.token_ids)
        assert p.propose(seq, 5) == reference_lookup(ids, 5, 4, 2)
        assert p.propose_after(seq, [1, 2], 3) == reference_lookup(ids + [1, 2], 3, 4, 2)
        assert p.worth_waiting(seq) == (seq.num_output_tokens > 0 and reference_lookup(ids[:-1], 1, 4, 2) == ids[-1:])
        seq.token_ids.extend(rng.integers(0, 6, int(rng.integers(1, 3))).tolist())
    p.begin([])
    assert p._arrays == {}  # a sequence that stopped running is forgotten
