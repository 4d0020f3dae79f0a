"""A step's host inputs packed into one buffer per dtype and unpacked inside the jitted step."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.engine.step_inputs import InputLayout


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 100, 5).astype(np.int32),
            {"scale": np.float32(rng.random()), "table": rng.random((2, 3)).astype(np.float32),
             "history": jnp.full((2, 4), seed, jnp.int32)},  # device-resident: passed through
            np.bool_(seed % 2), rng.integers(0, 2**32, (2, 2), dtype=np.uint32), rng.integers(0, 9, (3, 1)).astype(
                np.int32))


def test_every_step_packs_into_its_buckets_layout_and_unpacks_exactly():
    layout = InputLayout.of(_inputs(0))
    assert layout.dtypes == (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.bool_), np.dtype(np.uint32))
    unpack = jax.jit(layout.unpack)
    for seed in (1, 2):
        step = _inputs(seed)
        buffers, passed = layout.pack(step)
        assert [b.size for b in buffers] == [8, 7, 1, 4] and len(passed) == 1
        got = unpack(buffers, passed)
        want_leaves, want_def = jax.tree.flatten(step)
        got_leaves, got_def = jax.tree.flatten(got)
        assert got_def == want_def
        for g, w in zip(got_leaves, want_leaves, strict=True):
            assert g.shape == np.shape(w) and g.dtype == np.asarray(w).dtype
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_leaf_passed_through_may_be_built_on_the_host_in_a_later_step():
    """An empty step's device-resident leaves (no penalties: a reused history) pass through unpacked, also on a
    step that builds them on the host: the executable's arguments keep their shapes."""
    layout = InputLayout.of(_inputs(0))
    step = _inputs(3)
    step[1]["history"] = np.arange(8, dtype=np.int32).reshape(2, 4)
    buffers, passed = layout.pack(step)
    assert len(passed) == 1 and passed[0] is step[1]["history"]
    np.testing.assert_array_equal(np.asarray(jax.jit(layout.unpack)(buffers, passed)[1]["history"]),
                                  step[1]["history"])
