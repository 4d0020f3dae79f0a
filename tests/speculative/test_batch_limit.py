"""`disable_by_batch_size="auto"`: the smallest batch whose fully drafted step costs more than (1 + k) / 2 of its
plain steps, read from the target's steps at warm-up; never where steps barely grow with their rows."""

import logging

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.speculative import Drafter, SpeculativeConfig, batch_limit
from jaxllm.speculative.methods import ProposerContext
from tests.speculative.test_draft_model import OPTIONS
from tests.speculative.test_drafter import decoding


class RowClock:
    """A runner whose steps cost `fixed + per_row * rows` (step times as a deterministic line), in power-of-two
    token buckets up to `largest`; it keeps the steps it was asked to time."""

    def __init__(self, fixed: float, per_row: float, largest: int = 64):
        self.fixed, self.per_row, self.largest = fixed, per_row, largest
        self.timed = []

    def bucket_for(self, tokens: int, seqs: int) -> tuple[int, int]:
        t = 1
        while t < tokens:
            t *= 2
        if t > self.largest:
            raise ValueError(f"no bucket holds {tokens} tokens / {seqs} sequences")
        return t, min(t, 16)

    def time_step(self, step, runs: int = 3, back_to_back: bool = False) -> float:
        self.timed.append((step, back_to_back))
        return self.fixed + self.per_row * self.bucket_for(step.num_tokens, len(step.seqs))[0]


def limit(k: int, fixed: float, per_row: float, max_num_seqs: int = 64, largest: int = 64) -> int | None:
    return batch_limit.resolve(k, batch_limit.measure(RowClock(fixed, per_row, largest), k, max_num_seqs, 512, 16,
                                                      4096))


def test_the_limit_is_the_first_batch_whose_drafted_step_costs_more_than_half_its_rows():
    # k = 3, a step costs 4 rows' worth plus its rows: S = 1: 8 / 5, 2: 12 / 6, 4: 20 / 8 = 2.5 > (1 + 3) / 2
    assert limit(3, 4.0, 1.0) == 4
    assert limit(3, 2.0, 1.0) == 2  # a smaller fixed part: rows weigh sooner
    assert limit(3, 100.0, 1.0) is None  # bound by the fixed part (reading the weights): drafts pay
    # k = 7: 8 rows a sequence, and a drafted step must cost more than 4 plain ones (S = 4: 36 / 8)
    assert limit(7, 4.0, 1.0) == 4


def test_probes_stop_where_no_bucket_holds_the_drafted_step_and_at_the_batch_cap():
    def probed(k, max_num_seqs, largest=64):
        clock = RowClock(100.0, 1.0, largest)
        return [s for s, _, _ in batch_limit.measure(clock, k, max_num_seqs, 512, 16, 4096)], clock
    assert probed(7, 64)[0] == [1, 2, 4, 8]  # 16 x 8 = 128 tokens: no bucket
    assert probed(1, 4)[0] == [1, 2, 4]  # max_num_seqs 4
    sizes, clock = probed(1, 64, 4096)
    assert sizes[-1] == batch_limit.MAX_PROBED_SEQS
    # per batch size, its plain step back to back, then its drafted step: S sequences at CONTEXT tokens each
    (plain, ahead), (drafted, alone) = clock.timed[-2:]
    assert ahead and not alone and plain.num_new_tokens == [1] * 16 and drafted.num_new_tokens == [2] * 16
    assert drafted.drafts == [[0]] * 16 and {len(s.token_ids) for s in drafted.seqs} == {batch_limit.CONTEXT}


def test_probes_fit_the_cache_or_do_not_run():
    clock = RowClock(4.0, 1.0)
    measured = batch_limit.measure(clock, 3, 16, 512, 16, 10)  # 160 slots: a context of 157 tokens
    assert measured and {len(s.token_ids) for step, _ in clock.timed for s in step.seqs} == {157}
    assert max(p for step, _ in clock.timed for s in step.seqs for p in s.block_table) < 10
    assert batch_limit.measure(RowClock(4.0, 1.0), 3, 16, 512, 1, 4) == []  # 4 slots: no probe fits


@pytest.mark.parametrize("num_pages", [4096, 20])
def test_probe_sequences_have_their_own_pages_where_the_cache_holds_them(num_pages):
    step = batch_limit.probe_step(4, 3, 100, 16, num_pages)  # 7 pages a sequence
    tables = [s.block_table for s in step.seqs]
    assert all(len(t) == 7 for t in tables) and all(s.num_computed_tokens == 99 for s in step.seqs)
    assert len({p for t in tables for p in t}) == (28 if num_pages >= 28 else 7)


def test_the_drafter_times_steps_only_for_auto():
    clock = RowClock(4.0, 1.0)
    auto = Drafter(SpeculativeConfig("ngram", num_speculative_tokens=3), max_model_len=512,
                   context=ProposerContext(512, 16, 4096))
    assert auto.batch_limit is None  # until the steps are timed: drafts whatever the batch
    auto.limit_batches(clock, max_num_seqs=16)
    assert auto.batch_limit == 4 and len(clock.timed) == 10  # S = 1..16, plain and drafted
    seqs = [decoding(SamplingParams()) for _ in range(4)]
    auto.propose(seqs[:3])
    assert all(s.drafts for s in seqs[:3])
    auto.propose(seqs)
    assert all(s.drafts == [] for s in seqs)  # 4 running: none
    for value in (None, 2):
        fixed = Drafter(SpeculativeConfig("ngram", disable_by_batch_size=value), max_model_len=64)
        fixed.limit_batches(clock, max_num_seqs=16)
        assert fixed.batch_limit == value and len(clock.timed) == 10  # nothing timed


def test_an_engine_reads_its_limit_from_its_own_steps_and_serves_the_same_tokens(tiny_folder, compile_cache_dir,
                                                                                 caplog):
    with caplog.at_level(logging.INFO, logger="jaxllm.speculative.drafter"):
        spec = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **OPTIONS,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    # the probes ran: their times, S = 1 first (max_num_seqs 16, buckets up to 64 tokens: S = 1..16)
    probed = [r.getMessage() for r in caplog.records if "plain / drafted step ms by batch size: 1: " in r.getMessage()]
    assert len(probed) == 1 and "16: " in probed[0]
    plain = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **OPTIONS)
    limit_ = spec.engine.drafter.batch_limit
    assert limit_ is None or 1 <= limit_ <= batch_limit.MAX_PROBED_SEQS
    bm = spec.engine.block_manager
    assert bm.num_free_pages == bm.num_pages  # the probes took no page from the block manager
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6] * (i + 1)} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert bm.num_free_pages == bm.num_pages
