"""A step's small host inputs packed into one array and taken apart in the step (`jaxllm.engine.input_packing`):
every packed leaf comes back bit for bit (int32, uint32, float32 with NaN and -inf, bools), the token ids and the
device-resident constants are never packed, a bucket's layout is found from the shapes alone, and a leaf that is
not the host array its layout packs is refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine.input_packing import InputPacker, layout_of
from jaxllm.engine.sampling_inputs import SamplingInputs
from jaxllm.engine.scheduler import ScheduledStep
from jaxllm.engine.step_inputs import StepInputBuilder

BUCKETS = [(1, 1), (8, 8), (64, 8)]


def _builder(sample_positions: int = 1, lora: bool = False) -> StepInputBuilder:
    sampling = SamplingInputs(vocab_size=100, max_model_len=64, eos_token_ids=(2,), row_buckets=[s for _, s in BUCKETS])
    return StepInputBuilder(buckets=BUCKETS, page_size=16, max_model_len=64, sampling=sampling,
                            sample_positions=sample_positions, lora=lora)


def _random_like(leaf, rng):
    shape, dtype = np.shape(leaf), np.dtype(leaf.dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if dtype.kind == "f":
        out = rng.standard_normal(shape).astype(dtype)
        if out.size >= 2:
            out.reshape(-1)[:2] = [np.nan, -np.inf]  # bits, not values, must survive
        return out if shape else dtype.type(out)
    info = np.iinfo(dtype)
    out = rng.integers(info.min, info.max, shape, dtype=np.int64 if dtype != np.uint32 else np.uint64).astype(dtype)
    return out if shape else dtype.type(out)


@pytest.mark.parametrize(("sample_positions", "lora"), [(1, False), (3, True)])
@pytest.mark.parametrize("bucket", BUCKETS)
def test_every_packed_leaf_comes_back_bit_for_bit(bucket, sample_positions, lora):
    builder = _builder(sample_positions, lora)
    packer = InputPacker(lambda b: builder.build(ScheduledStep([], []), b).inputs, BUCKETS)
    template = builder.build(ScheduledStep([], []), bucket).inputs
    layout = packer.layout(bucket)
    leaves, treedef = jax.tree.flatten(template)
    packed_index = {s.index for s in layout.slots}
    assert 0 not in packed_index  # the ids: a step dispatched ahead takes them from the device
    assert all(isinstance(leaves[i], jax.Array) for i in range(len(leaves)) if i not in packed_index and i)
    assert {np.dtype(leaves[i].dtype) for i in packed_index} >= {np.dtype(np.int32), np.dtype(np.float32),
                                                                 np.dtype(np.bool_)}
    rng = np.random.default_rng(sum(bucket) + sample_positions)
    values = [(_random_like(leaf, rng) if i in packed_index else leaf) for i, leaf in enumerate(leaves)]
    values[0] = jnp.asarray(rng.integers(0, 100, bucket[0]), jnp.int32)  # ids on the device (a step ahead)
    inputs = jax.tree.unflatten(treedef, values)
    buffer, rest = packer.pack(bucket, inputs)
    assert buffer.dtype == np.uint8 and buffer.shape == (layout.nbytes,) and layout.nbytes % 4 == 0
    assert len(rest) == len(leaves) - len(packed_index)
    back = jax.jit(packer.unpack)(buffer, rest)
    for got, want in zip(jax.tree.leaves(back), values, strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


def test_a_bucket_is_found_from_the_shapes_and_wrong_leaves_are_refused():
    builder = _builder()
    packer = InputPacker(lambda b: builder.build(ScheduledStep([], []), b).inputs, BUCKETS)
    sizes = {b: packer.layout(b).nbytes for b in BUCKETS}
    assert sizes[(64, 8)] > sizes[(8, 8)] > sizes[(1, 1)]
    inputs = builder.build(ScheduledStep([], []), (8, 8)).inputs
    buffer, rest = packer.pack((8, 8), inputs)
    assert jax.tree.structure(jax.jit(packer.unpack)(buffer, rest)) == jax.tree.structure(inputs)
    with pytest.raises(ValueError, match="0 buckets"):
        packer.unpack(np.zeros(buffer.shape[0] + 4, np.uint8), rest)
    on_device = dataclasses.replace(inputs, logit_rows=jnp.asarray(inputs.logit_rows))
    with pytest.raises(TypeError, match="not the host array"):
        packer.pack((8, 8), on_device)
    with pytest.raises(TypeError, match="are PyTreeDef"):
        packer.pack((8, 8), dataclasses.replace(inputs, lora=np.zeros(8, np.int32)))


def test_the_layout_of_an_empty_step_packs_only_host_arrays():
    template = _builder().build(ScheduledStep([], []), (8, 8)).inputs
    layout = layout_of(template)
    leaves = jax.tree.leaves(template)
    assert layout.slots and all(isinstance(leaves[s.index], np.ndarray | np.generic) for s in layout.slots)
    ends = [s.offset + s.nbytes for s in layout.slots]
    assert all(s.offset % 4 == 0 for s in layout.slots) and max(ends) <= layout.nbytes
    assert all(a <= b.offset for a, b in zip(ends, layout.slots[1:], strict=False))  # no overlaps
