"""Block manager and scheduler in plain Python: prefix caching, chunked prefill, preemption, aborts, leaks."""

import random

from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Request, Sequence, SequenceStatus
from jaxllm.sampling_params import SamplingParams

PAGE = 4


def make_request(rid, prompt, n=1, max_tokens=8):
    params = SamplingParams(n=n, max_tokens=max_tokens)
    request = Request(str(rid), None, prompt, params, seed=0)
    for i in range(n):
        request.seqs.append(Sequence(request, i, IncrementalDetokenizer(
            None, prompt, skip_special_tokens=True, stop=(), include_stop_str_in_output=False)))
    return request


def run_step(sched: Scheduler, bm: BlockManager, rng=None) -> list[Sequence]:
    """Plays the engine: marks scheduled tokens computed, appends a token to sequences that reached the end,
    finishes those at max_tokens."""
    step = sched.schedule()
    for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
        assert len(seq.block_table) * PAGE >= seq.num_computed_tokens + n
    sched.update_from_output(step)
    for seq in step.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng.randrange(1000) if rng else 7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "stop")
    return step.seqs


def test_prefix_cache_hit_computes_only_new_tokens():
    bm = BlockManager(64, PAGE)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    prefix = list(range(100, 130))  # 30 tokens: 7 full pages
    first = make_request(1, prefix + [1, 2], max_tokens=1)
    sched.add(first.seqs[0])
    run_step(sched, bm)
    assert first.finished and bm.num_free_pages == 64  # freed, but its pages keep their cached contents
    second = make_request(2, prefix + [3, 4, 5], max_tokens=1)
    sched.add(second.seqs[0])
    step = sched.schedule()
    assert step.seqs == second.seqs
    # 32 prompt tokens of the first request filled 8 pages; the second shares the first 7 (28 tokens).
    assert second.seqs[0].num_cached_tokens == 28
    assert step.num_new_tokens == [33 - 28]
    assert second.seqs[0].block_table[:7] == list(range(7))  # a fresh manager handed out pages 0..7 first


def test_identical_prompt_recomputes_at_least_one_token():
    bm = BlockManager(16, PAGE)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_request(1, list(range(8)), max_tokens=1)
    sched.add(a.seqs[0])
    run_step(sched, bm)
    b = make_request(2, list(range(8)), max_tokens=1)
    sched.add(b.seqs[0])
    step = sched.schedule()
    assert step.num_new_tokens == [4] and b.seqs[0].num_cached_tokens == 4  # the last page is recomputed


def test_chunked_prefill_of_prompt_longer_than_budget_runs_beside_decodes():
    bm = BlockManager(64, PAGE)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    short = make_request(1, [1, 2, 3], max_tokens=20)
    sched.add(short.seqs[0])
    run_step(sched, bm)  # short is decoding from now on
    long = make_request(2, list(range(50)), max_tokens=2)
    sched.add(long.seqs[0])
    chunks = []
    while long.seqs[0].num_output_tokens == 0:
        step = sched.schedule()
        assert step.num_tokens <= 16
        assert short.seqs[0] in step.seqs  # the decode is never starved by the prefill
        chunks.append(step.num_new_tokens[step.seqs.index(long.seqs[0])])
        sched.update_from_output(step)
        for seq in step.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(5)
    assert sum(chunks) == 50 and len(chunks) == 4 and max(chunks) == 15


def test_preemption_when_pages_run_out_and_everyone_finishes():
    bm = BlockManager(10, PAGE)  # 40 token slots for 4 sequences that need 20 each
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    requests = [make_request(i, [i] * 10, max_tokens=10) for i in range(4)]
    for r in requests:
        sched.add(r.seqs[0])
    for _ in range(200):
        if not sched.has_work():
            break
        run_step(sched, bm)
    assert all(r.finished and r.seqs[0].num_output_tokens == 10 for r in requests)
    assert sched.num_preemptions > 0
    assert bm.num_free_pages == 10 and all(c == 0 for c in bm.ref_counts)


def queued(prompt: list[int], n: int, budget: int, pages: int = 64) -> tuple[BlockManager, Scheduler, Request]:
    """A scheduler with one request of n choices waiting."""
    bm = BlockManager(pages, PAGE)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget)
    r = make_request(1, prompt, n=n)
    for s in r.seqs:
        sched.add(s)
    return bm, sched, r


def test_abort_frees_every_page():
    bm, sched, r = queued(list(range(30)), n=2, budget=8, pages=32)
    run_step(sched, bm)
    assert bm.num_free_pages < 32
    for s in r.seqs:
        sched.finish(s, "stop")
    assert bm.num_free_pages == 32 and not sched.running and not sched.waiting


def test_n_choices_share_the_prompt_pages():
    bm, sched, r = queued(list(range(21)), n=3, budget=64)
    step = sched.schedule()
    leader, *others = r.seqs
    assert step.seqs == r.seqs and step.num_new_tokens == [21, 1, 1]  # the others compute the last token only
    for s in others:
        assert s.num_cached_tokens == 20 and s.block_table[:5] == leader.block_table[:5]
    assert bm.ref_counts[leader.block_table[0]] == 3
    sched.update_from_output(step)
    assert all(s.page_hashes == leader.page_hashes[:5] for s in others)
    assert not bm.promised and len(bm.page_of_hash) == 5  # registered once, by the leader that wrote them


def test_choices_wait_for_a_prompt_chunked_over_steps():
    _, sched, r = queued(list(range(21)), n=2, budget=12)
    assert sched.schedule().seqs == [r.seqs[0]]  # its chunk does not reach the prompt's end


def test_a_prompt_admitted_in_the_same_step_shares_the_pages_being_filled():
    """Pages another request fills in the step being scheduled are hits (every kernel writes the step's K/V before
    attending); a request with another cache_salt never shares them, and the promises end with the step."""
    bm = BlockManager(64, PAGE)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(100, 118))  # 4 full pages and 2 tokens
    first, second = make_request(1, prompt), make_request(2, prompt[:14] + [5, 6, 7])
    salted = make_request(3, prompt)
    salted.cache_salt = "tenant-b"
    for r in (first, second, salted):
        sched.add(r.seqs[0])
    step = sched.schedule()
    a, b, c = (r.seqs[0] for r in (first, second, salted))
    assert step.seqs == [a, b, c] and step.num_new_tokens == [18, 5, 18]
    assert b.block_table[:3] == a.block_table[:3] and b.num_cached_tokens == 12  # page 4 differs
    assert c.num_cached_tokens == 0 and not set(c.block_table) & set(a.block_table)
    assert not bm.promised
    sched.update_from_output(step)
    later = make_request(4, prompt)
    sched.add(later.seqs[0])
    sched.schedule()
    assert later.seqs[0].block_table[:4] == a.block_table[:4]
    for r in (first, second, salted, later):
        sched.finish(r.seqs[0], "abort")
    assert bm.num_free_pages == 64


def test_no_page_leaks_after_1000_random_requests():
    rng = random.Random(0)
    bm = BlockManager(96, PAGE)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=48)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 40))] for _ in range(10)]
    requests, added = [], 0
    while added < 1000 or sched.has_work():
        for _ in range(rng.randrange(0, 4)):
            if added < 1000:
                prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
                r = make_request(added, prompt, n=rng.choice([1, 1, 2]), max_tokens=rng.randrange(1, 12))
                requests.append(r)
                for s in r.seqs:
                    sched.add(s)
                added += 1
        run_step(sched, bm, rng)
        if rng.random() < 0.05 and sched.running:  # random aborts
            victim = rng.choice(sched.running)
            for s in victim.request.seqs:
                if not s.finished:
                    sched.finish(s, "stop")
        assert bm.num_free_pages + sum(1 for c in bm.ref_counts if c > 0) == 96
    assert all(s.status == SequenceStatus.FINISHED for r in requests for s in r.seqs)
    assert bm.num_free_pages == 96 and all(c == 0 for c in bm.ref_counts)
    assert bm.prefix_hits > 0 and sched.num_preemptions > 0


def test_a_guessed_step_grows_pages_past_the_one_in_flight_and_gives_them_back():
    bm = BlockManager(16, PAGE)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    request = make_request(1, list(range(10)), max_tokens=40)
    seq = request.seqs[0]
    sched.add(seq)
    run_step(sched, bm)  # the prompt: 10 computed, a token appended
    seq.drafts = [1, 2, 3]
    step = sched.schedule()
    assert step.num_new_tokens == [4] and len(seq.block_table) == 4  # 14 tokens' KV: 4 pages
    assert sched.lookahead_guessed(step, [([1, 2, 3, 4], list(range(16)))]) is None  # past the token budget
    assert len(seq.block_table) == 4
    guessed = sched.lookahead_guessed(step, [([1, 2, 3, 4], [5, 6])])  # 10 + 4 gained, then 4 and 2 drafts
    assert guessed.num_new_tokens == [3] and guessed.drafts == [[5, 6]]
    assert len(seq.block_table) == 5 and seq.num_computed_tokens == 10  # 17 tokens' KV: 5 pages; progress as was
    sched.update_from_output(step, rejected=[2])  # the step kept one draft: the guess failed
    sched.drop_guessed(guessed)
    assert seq.num_computed_tokens == 12 and len(seq.block_table) == 3
    sched.finish(seq, "abort")
    assert bm.num_free_pages == 16


def test_reset_prefix_cache_forgets_pages_only_when_none_is_in_use():
    bm = BlockManager(64, PAGE)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    prefix = list(range(100, 130))
    first = make_request(1, prefix + [1, 2], max_tokens=2)
    sched.add(first.seqs[0])
    run_step(sched, bm)
    assert not first.finished and not bm.reset_prefix_cache()  # a page in use: refused, nothing forgotten
    run_step(sched, bm)
    assert first.finished and bm.reset_prefix_cache()
    second = make_request(2, prefix + [3, 4, 5], max_tokens=1)
    sched.add(second.seqs[0])
    step = sched.schedule()
    assert step.num_new_tokens == [33] and bm.prefix_hits == 0  # the whole prompt again
