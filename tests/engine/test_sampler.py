"""The device sampler: empirical distributions after filtering, penalties, bias, seeds, logprobs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jaxllm.engine.sampler import SamplingTensors, _apply_penalties, argmax_last, sample

V = 12


def tensors(rows, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, rep=1.0, freq=0.0, pres=0.0, seeds=None,
            steps=None, history=None, num_prompt=None, bias=None, choices=None, mask=None):
    full = lambda v, dt: jnp.full((rows,), v, dt)  # noqa: E731
    hist = jnp.full((rows, 1), -1, jnp.int32) if history is None else jnp.asarray(history, jnp.int32)
    bias_ids = jnp.full((rows, 4), -1, jnp.int32)
    bias_values = jnp.zeros((rows, 4), jnp.float32)
    if bias:
        bias_ids = bias_ids.at[:, :len(bias)].set(jnp.asarray(list(bias)))
        bias_values = bias_values.at[:, :len(bias)].set(jnp.asarray(list(bias.values()), jnp.float32))
    return SamplingTensors(
        full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32), full(min_p, jnp.float32),
        full(rep, jnp.float32), full(freq, jnp.float32), full(pres, jnp.float32),
        seed_words(seeds if seeds is not None else np.zeros(rows, np.int64)),
        jnp.asarray(choices if choices is not None else np.zeros(rows), jnp.int32),
        jnp.asarray(steps if steps is not None else np.arange(rows), jnp.int32), bias_ids, bias_values, hist,
        jnp.asarray(num_prompt if num_prompt is not None else np.zeros(rows), jnp.int32),
        jnp.bool_(top_k > 0 or top_p < 1 or min_p > 0), jnp.bool_(rep != 1 or freq != 0 or pres != 0),
        jnp.bool_(temperature > 0), jnp.bool_(True),
        jnp.full((rows, 1 if mask is None else mask.shape[1]), -1, jnp.int32) if mask is None else jnp.asarray(mask),
        jnp.bool_(mask is not None), jnp.bool_(bool(bias)))


def seed_words(seeds):
    """64-bit seeds -> [rows, 2] uint32 (low, high), as the model runner passes them."""
    seeds = [int(x) % (1 << 64) for x in seeds]
    return jnp.asarray([(x & 0xFFFFFFFF, x >> 32) for x in seeds], jnp.uint32)


def expected_distribution(logits, temperature, top_k, top_p, min_p):
    """softmax(logits / T), then top-k, top-p (on the renormalised top-k mass), min-p, renormalised."""
    z = logits / temperature
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    k = top_k or len(z)
    p = np.exp(z[order[:k]] - z[order[0]])
    p /= p.sum()
    mass = 0.0
    for rank, token in enumerate(order[:k]):
        if mass >= top_p:
            break
        keep[token] = True
        mass += p[rank]
    probs = np.exp(z - z.max())
    keep &= probs >= min_p * probs.max()
    probs = np.where(keep, probs, 0)
    return probs / probs.sum()


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1),
    (0.9, 6, 0.9, 0.05)])
def test_empirical_distribution_matches_filtered_softmax(temperature, top_k, top_p, min_p):
    logits = np.random.default_rng(1).normal(0, 1.5, V).astype(np.float32)
    n = 20000
    t = tensors(n, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=np.full(n, 42))
    tokens = np.asarray(jax.jit(sample)(jnp.tile(logits, (n, 1)), t)[0])
    expected = expected_distribution(logits.astype(np.float64), temperature, top_k, top_p, min_p)
    counts = np.bincount(tokens, minlength=V)
    assert counts[expected == 0].sum() == 0  # filtered tokens never appear
    allowed = expected > 0
    result = chisquare(counts[allowed], expected[allowed] * n)
    assert result.pvalue > 1e-3, (counts, expected * n)


def test_penalties_follow_openai_and_vllm_definitions():
    logits = np.array([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]], np.float32)
    history = np.array([[0, 1, 1, 3, 3, 3, -1]])  # prompt: tokens 0, 1; output: 1, 3, 3, 3
    t = tensors(1, rep=1.5, freq=0.4, pres=0.3, history=history, num_prompt=[2])
    got = np.asarray(_apply_penalties(jnp.asarray(logits), t))[0]
    counts = np.array([0, 1, 0, 3, 0, 0])  # output tokens only
    seen = np.array([1, 1, 0, 1, 0, 0], bool)  # prompt and output
    want = logits[0].copy()
    want = np.where(seen, np.where(want > 0, want / 1.5, want * 1.5), want)
    want = want - 0.4 * counts - 0.3 * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[2] == logits[0, 2] and got[5] == logits[0, 5]  # unseen tokens untouched


def test_greedy_bias_and_logprobs():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0]], jnp.float32)
    tokens, lp, rank, top_ids, top_lp = sample(logits, tensors(1, temperature=0.0))
    assert int(tokens[0]) == 1 and int(rank[0]) == 1
    np.testing.assert_allclose(float(lp[0]), float(jax.nn.log_softmax(logits)[0, 1]), rtol=1e-6)
    assert top_ids[0, :4].tolist() == [1, 3, 2, 0]
    # a sampled token's rank is 1 + the number of likelier tokens, wherever it falls
    forced = sample(logits, tensors(1, temperature=0.0, bias={0: 10.0}))
    assert int(forced[0][0]) == 0 and int(forced[2][0]) == 4  # the bias picks it; the raw logits rank it last
    biased = sample(logits, tensors(1, temperature=0.0, bias={1: -100.0, 2: 5.0}))[0]
    assert int(biased[0]) == 2
    banned = sample(logits, tensors(1, temperature=1.0, bias={1: -jnp.inf, 3: -jnp.inf}, steps=[0]))[0]
    assert int(banned[0]) in (0, 2)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_a_greedy_only_step_takes_the_argmax_branch(platform):
    """Nothing but greedy tokens asked for: the argmax of the raw logits (ties: the first), zero logprobs; the
    same tokens as the full path; and any bias, logprobs or sampling row sends the step down the full path."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(0, 1, (6, 3000)), jnp.float32).at[2, 7].set(9.0).at[2, 11].set(9.0)
    plain = dataclasses.replace(tensors(6, temperature=0.0), any_logprobs=jnp.bool_(False))
    assert bool(plain.only_greedy)
    tokens, lp, rank, top_ids, top_lp = sample(logits, plain, platform)
    assert tokens.tolist() == np.argmax(np.asarray(logits), axis=1).tolist() and int(tokens[2]) == 7
    assert not np.any(np.asarray(lp)) and not np.any(np.asarray(top_ids)) and not np.any(np.asarray(top_lp))
    assert not np.any(np.asarray(rank))
    assert sample(logits, tensors(6, temperature=0.0), platform)[0].tolist() == tokens.tolist()  # full path
    for flag in ("any_logprobs", "any_random", "any_bias", "any_penalty", "any_mask"):
        assert not bool(dataclasses.replace(plain, **{flag: jnp.bool_(True)}).only_greedy), flag


def test_seeded_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(0, 1, (4, 1000)), jnp.float32)
    t = tensors(4, seeds=[7, 8, 9, 7], steps=[5, 5, 5, 6])
    alone = sample(logits[:1], tensors(1, seeds=[7], steps=[5]))[0]
    together = sample(logits, t)[0]
    assert int(alone[0]) == int(together[0])
    draws = [int(sample(logits[:1], tensors(1, seeds=[s], steps=[0]))[0][0]) for s in range(20)]
    assert len(set(draws)) > 5  # different seeds do sample differently


def test_keys_differ_for_every_seed_choice_and_token():
    """The old key (token * 131 + choice) repeated once n exceeded 131, and seeds were cut to 32 bits."""
    logits = jnp.zeros((1, 1 << 16), jnp.float32)  # uniform over 65536 tokens: equal keys <=> equal draws
    rows = [(0, 131, 0), (0, 0, 1), (0, 200, 0), (0, 69, 1), (1 << 32, 0, 0), (0, 0, 0), (-1, 0, 0),
            ((1 << 64) - 1, 0, 0)]
    draws = [int(sample(logits, tensors(1, seeds=[seed], choices=[choice], steps=[step]))[0][0])
             for seed, choice, step in rows]
    assert draws[-1] == draws[-2]  # -1 and 2**64 - 1 are the same 64-bit seed
    assert len(set(draws[:-1])) == len(draws) - 1, draws


@pytest.mark.parametrize("vocab", [7, 1024, 3000, 49152])
def test_blocked_argmax_equals_argmax_ties_included(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 4, (9, vocab)).astype(np.float32)  # many ties: the first maximum must win
    x[0, :] = -np.inf
    x[1, -1] = 100.0  # the maximum in the last (partial) block
    np.testing.assert_array_equal(np.asarray(argmax_last(jnp.asarray(x), block=1024)), np.argmax(x, axis=-1))


def _bitmask(allowed_rows, vocab):
    words = np.zeros((len(allowed_rows), (vocab + 31) // 32), np.uint32)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            words[r, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return words.view(np.int32)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_token_mask_is_applied_before_sampling_and_logprobs(temperature):
    vocab = 70  # three mask words, the last one partial
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, vocab)), jnp.float32)
    allowed = [[3, 40], [69], list(range(vocab))]  # the last row is unconstrained (all ones)
    t = tensors(3, temperature=temperature, mask=_bitmask(allowed, vocab))
    tokens, logprobs, _, top_ids, top_lps = sample(logits, t)
    assert int(tokens[0]) in (3, 40) and int(tokens[1]) == 69
    assert float(logprobs[1]) == pytest.approx(0.0, abs=1e-6)  # the only allowed token: probability 1
    row0 = dict(zip(np.asarray(top_ids[0]).tolist(), np.asarray(top_lps[0]).tolist(), strict=True))
    assert np.exp(row0[3]) + np.exp(row0[40]) == pytest.approx(1.0, abs=1e-5)
    assert all(lp == -np.inf for tid, lp in row0.items() if tid not in (3, 40))
    free = sample(logits[2:], tensors(1, temperature=temperature, seeds=[0], steps=[2]))
    assert int(tokens[2]) == int(free[0][0])  # an all-ones row is untouched


def test_several_sample_positions_draw_as_the_following_steps_would():
    """A step that samples several positions of a sequence (speculation's verification) gives position j the key
    of the sequence's token index + j: the same draw as the j-th next one-position step from the same logits."""
    from jaxllm.engine.step_function import per_sample_row

    rows, k, vocab = 3, 4, 64
    logits = jax.random.normal(jax.random.key(0), (rows, vocab)) * 3
    t = tensors(rows, temperature=0.8, seeds=[11, 12, 13], steps=[5, 0, 9])
    seq, offset = np.repeat(np.arange(rows), k), np.tile(np.arange(k), rows)
    wide = per_sample_row(t, jnp.asarray(seq, jnp.int32), jnp.asarray(offset, jnp.int32))
    assert wide.temperature.shape == (rows * k,) and wide.any_random.shape == ()
    np.testing.assert_array_equal(np.asarray(wide.steps).reshape(rows, k), [[5, 6, 7, 8], [0, 1, 2, 3],
                                                                           [9, 10, 11, 12]])
    got = np.asarray(sample(jnp.repeat(logits, k, axis=0), wide)[0]).reshape(rows, k)
    for j in range(k):
        one = tensors(rows, temperature=0.8, seeds=[11, 12, 13], steps=[5 + j, j, 9 + j])
        np.testing.assert_array_equal(got[:, j], np.asarray(sample(logits, one)[0]))
    assert len(set(got.reshape(-1).tolist())) > rows  # the positions do draw differently


def test_sample_rows_read_their_sequences_history():
    """Penalties in a step with several sample rows per sequence: each row reads its own sequence's history (the
    history stays [S, L]; rows point into it)."""
    from jaxllm.engine.step_function import per_sample_row

    vocab = 16
    logits = jnp.zeros((2, vocab)).at[:, 3].set(1.0).at[:, 5].set(0.9)
    t = tensors(2, temperature=0.0, rep=1.0, pres=0.5, history=[[3, -1], [5, -1]], num_prompt=[0, 0])
    seq = jnp.asarray([1, 1, 0], jnp.int32)
    wide = per_sample_row(t, seq, jnp.asarray([0, 1, 0], jnp.int32))
    got = np.asarray(sample(logits[jnp.asarray([1, 1, 0])], wide)[0]).tolist()
    assert got == [3, 3, 5]  # sequence 1 saw 5 (penalized: 3 wins), sequence 0 saw 3 (5 wins)
