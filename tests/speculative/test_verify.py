"""Keeping the drafts the target agrees with, and vLLM's counters of them."""

import numpy as np

from jaxllm.speculative.verify import SpecDecodeStats, accepted


def test_drafts_are_kept_up_to_the_first_the_target_disagrees_with():
    assert accepted(np.array([5, 6, 7, 8]), [5, 6, 7]) == [5, 6, 7, 8]  # all kept, plus the target's next
    assert accepted(np.array([5, 9, 7, 8]), [5, 6, 7]) == [5, 9]  # the target's own token where it disagrees
    assert accepted(np.array([4, 6, 7, 8]), [5, 6, 7]) == [4]
    assert accepted(np.array([3, 1, 1]), []) == [3]  # no drafts: one token, as a plain step
    assert accepted(np.array([5, 6, 2, 2, 2]), [5, 6]) == [5, 6, 2]  # padding rows after its samples are ignored


def test_counters():
    stats = SpecDecodeStats()
    stats.observe(4, 2)
    stats.observe(3, 3)
    stats.observe(0, 0)  # a sequence without drafts is not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 7, 5)
    assert stats.accepted_per_pos == [2, 2, 1, 0]
    assert stats.acceptance_rate == 5 / 7 and stats.mean_acceptance_length == 1 + 5 / 2
    assert stats.counters()["spec_decode_num_accepted_tokens_per_pos"] == [2, 2, 1, 0]
    assert SpecDecodeStats().acceptance_rate == 0.0
