"""Prefix-cache isolation: SHA-256 page hashes, every hit checked against what the page really holds, and
`cache_salt` keeping tenants' pages apart (vLLM advisory GHSA-rm76-4mrf-v9r8 is the attack this stops)."""

import pytest

from jaxllm.engine import block_manager as bm_module
from jaxllm.engine.block_manager import BlockManager, page_hash, root_hash
from jaxllm.engine.scheduler import Scheduler
from tests.engine.test_scheduler import PAGE, make_request, run_step


def admit_and_compute(sched, bm, request):
    """Runs steps until the request's prompt is computed (its full pages registered in the cache)."""
    for seq in request.seqs:
        sched.add(seq)
    while request.seqs[0].num_computed_tokens < request.seqs[0].num_prompt_tokens:
        run_step(sched, bm)
    return request.seqs[0]


def salted(rid, prompt, salt):
    request = make_request(rid, prompt)
    request.cache_salt = salt
    return request


def test_hashes_are_sha256_chained_and_salted():
    a, b = root_hash(None), root_hash("tenant-a")
    assert len(a) == 32 and a != b != root_hash("tenant-b")
    assert page_hash(a, [1, 2, 3, 4]) != page_hash(b, [1, 2, 3, 4])
    assert page_hash(a, [1, 2, 3, 4]) != page_hash(a, [1, 2, 3, 5])
    assert page_hash(page_hash(a, [1, 2, 3, 4]), [5]) != page_hash(page_hash(a, [9, 2, 3, 4]), [5])


def test_a_forced_hash_collision_reuses_no_wrong_page(monkeypatch):
    """With the hash made constant (every page collides), a prompt sharing no tokens with the cached one
    must get no cached page, while the real prefix still hits (the check is on contents, not on the hash)."""
    monkeypatch.setattr(bm_module, "page_hash", lambda prev, tokens, images=b"": b"\0" * 32)
    bm = BlockManager(64, PAGE)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    victim = list(range(100, 113))  # 3 full pages + 1 token
    admit_and_compute(sched, bm, make_request("victim", victim))
    assert len(bm.page_of_hash) == 1  # every page hashed the same: only the first got registered

    attacker = make_request("attacker", list(range(500, 513)))
    assert bm.cached_prefix(attacker.seqs[0]) == []
    # Same first page, different second page: at most the first page is shared.
    mixed = make_request("mixed", victim[:4] + [1, 2, 3, 4] + victim[8:])
    assert len(bm.cached_prefix(mixed.seqs[0])) <= 1
    same = make_request("same", victim)
    assert len(bm.cached_prefix(same.seqs[0])) == 1  # a true hit still works (the one registered page)


@pytest.mark.parametrize("collide", [False, True])
def test_pages_of_different_images_are_never_shared(monkeypatch, collide):
    """Image tokens are all the same id: the image's content hash tells pages apart, in the hash and in the key a
    hit is checked against (so even with every hash colliding, a different image gets no page)."""
    import numpy as np

    from jaxllm.engine.encoder_cache import EncoderCache
    from jaxllm.multimodal.inputs import ImageItem, MultiModalInputs

    if collide:
        monkeypatch.setattr(bm_module, "page_hash", lambda prev, tokens, images=b"": b"\0" * 32)

    def with_image(rid: str, digest: bytes):
        prompt = [5, 6, 7] + [99] * 8 + [8, 9, 10]  # the image's run straddles pages 0-2 (PAGE tokens each)
        request = make_request(rid, prompt)
        request.mm = MultiModalInputs((ImageItem(np.zeros((32, 4), np.float32), (1, 4, 8), 3, 8, digest),),
                                      np.zeros((3, len(prompt)), np.int32), 0)
        return request

    bm = BlockManager(64, PAGE)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, encoder_cache=EncoderCache(64),
                      encoder_budget=64)
    admit_and_compute(sched, bm, with_image("a", b"a" * 32))
    assert len(bm.cached_prefix(with_image("a2", b"a" * 32).seqs[0])) == (1 if collide else 3)
    assert bm.cached_prefix(with_image("b", b"b" * 32).seqs[0]) == []  # page 0 already holds image tokens


def test_a_collision_with_a_refilled_parent_page_is_refused(monkeypatch):
    """A cached child page whose parent page was evicted and refilled (same tokens, new generation) no longer
    holds this prefix's KV: the parent's generation in the child's key catches it."""
    bm = BlockManager(4, PAGE)
    prompt = list(range(1, 10))  # 2 full pages + 1
    seq = make_request("a", prompt).seqs[0]
    bm.grow(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.cache_full_pages(seq)
    first, second = seq.block_table[:2]
    bm.release(seq)
    assert bm.cached_prefix(make_request("b", prompt).seqs[0]) == [first, second]
    bm.generation[first] += 1  # as if the first page had been refilled with the same tokens and re-registered
    assert bm.cached_prefix(make_request("c", prompt).seqs[0]) == [first]  # the child is not trusted any more


def test_cache_salt_separates_tenants():
    bm = BlockManager(64, PAGE)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(200, 217))  # 4 full pages + 1
    admit_and_compute(sched, bm, salted("a1", prompt, "tenant-a"))
    assert bm.cached_prefix(salted("a2", prompt, "tenant-a").seqs[0]) != []  # same tenant: shared
    assert bm.cached_prefix(salted("b", prompt, "tenant-b").seqs[0]) == []  # other tenant: nothing
    assert bm.cached_prefix(make_request("unsalted", prompt).seqs[0]) == []  # no salt: nothing either


def test_a_rollback_frees_the_rejected_pages_and_their_prefix_cache_entries():
    """Speculation computes draft tokens and may reject them: rolled back, the sequence keeps only the pages its
    accepted tokens need, and no page holding a rejected token stays findable by its hash (its KV is rewritten
    by the next tokens)."""
    bm = BlockManager(32, PAGE)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(1, 11))  # 10 tokens: 2 full pages of 4 and 2 more
    seq = admit_and_compute(sched, bm, make_request("a", prompt, max_tokens=50))
    drafts = [91, 92, 93, 94, 95, 96]
    seq.token_ids.extend(drafts)  # what a draft model proposed: computed by the next (verification) step
    step = sched.schedule()
    assert step.seqs == [seq] and step.num_new_tokens == [len(drafts) + 1]
    sched.update_from_output(step)
    assert seq.num_computed_tokens == 17 and len(seq.page_hashes) == 4  # pages 2 and 3 hold drafts, hashed
    free_before = bm.num_free_pages
    probe = make_request("b", prompt + [7] + drafts + [0] * 4).seqs[0]  # the drafts as another prompt's
    assert len(bm.cached_prefix(probe)) == 4  # pages 0-3 (page 3: drafts 92-95) are cached
    # The verifier accepted one draft: progress back to 12 tokens (prompt, the sampled token 7, draft 91).
    sched.rollback(seq, 12)
    del seq.token_ids[12:]
    assert seq.num_computed_tokens == 12 and len(seq.block_table) == 3 and len(seq.page_hashes) == 3
    assert bm.num_free_pages == free_before + 2
    assert len(bm.cached_prefix(probe)) == 3  # page 2 (9, 10, 7, 91) was accepted; page 3 is forgotten
    with pytest.raises(ValueError):
        sched.rollback(seq, 13)  # forward is not a rollback
