"""Prompt lookup: the sequence's latest earlier occurrence of its last n tokens (longest n first) proposes what
followed it."""

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
