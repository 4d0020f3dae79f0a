"""The quantized matmul with the adapter term in the same call against the two kernels added by XLA: the same bits
for every int8 path this CPU runs (interleaved weights and lane loops), fused and plain layers (q/k/v's parts,
gate/up's alternating ones), 16-bit and float32 tables, tokens without an adapter or with a slot past the table,
a decode step (the first pass the launch's first chunk) and a bigger one (the first pass shared in the quantizing
launch)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pallas_kernels.lora_delta import cpu as lora_cpu
from pallas_kernels.lora_delta import cpu_fused
from pallas_kernels.quantized_matmul import cpu, isa
from pallas_kernels.quantized_matmul.interleave import interleave
from tests.pallas_kernels.quantized_matmul.test_matmul import _case

L, S, IN, R = 2, 3, 256, 8
QKV = np.tile(np.r_[np.zeros(64), np.ones(32), np.full(32, 2)], 2).astype(np.int32)  # 256 rows, parts by runs
GATE_UP = np.tile(np.arange(2), 160).astype(np.int32)  # 320 rows: 20 chunks of 16
ODD_RUNS = np.tile(np.r_[np.zeros(24), np.ones(8), np.full(8, 2)], 4).astype(np.int32)  # runs cut by chunks


def _paths():
    return [(p, x16) for p in isa.available() if p != "amx" for x16 in (False, True)
            if not x16 or p in cpu.X16_ISAS]


@pytest.fixture(params=_paths() or [None], ids=lambda p: "none" if p is None else f"{p[0]}{'-x16' if p[1] else ''}")
def path(request):
    if request.param is None:
        pytest.skip(f"no int8 path on this CPU ({isa.describe()})")
    return request.param


@pytest.mark.parametrize("parts", [None, QKV, GATE_UP, ODD_RUNS], ids=["one", "qkv", "gate_up", "odd_runs"])
@pytest.mark.parametrize("tokens", [1, 5, 64])  # 64: the first pass in the quantizing launch
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_call_gives_the_two_kernels_bits(path, parts, tokens, dtype):
    path_isa, x16 = path
    out = 208 if parts is None else len(parts)
    w, fmt, _ = _case(T.Q4_1, (L, out, IN))
    if x16:
        w = jax.tree.map(jnp.asarray, interleave(jax.tree.map(np.asarray, w), fmt))
        fmt = dataclasses.replace(fmt, interleaved=True)
    rng = np.random.default_rng(tokens)
    p = 1 if parts is None else int(parts.max()) + 1
    a = jnp.asarray(rng.standard_normal((L, S, p * R, IN)).astype(np.float32) * 0.1, dtype)
    b = jnp.asarray(rng.standard_normal((L, S, R, out)).astype(np.float32) * 0.1, dtype)
    x = jnp.asarray(rng.standard_normal((tokens, IN)).astype(np.float32))
    slots = jnp.asarray(np.resize(np.array([1, -1, 2, 5, 0], np.int32), tokens))  # 5: past the table, as none
    assert cpu_fused.applies(x, fmt, path_isa, a, b)

    @jax.jit
    def both(x, slots, layer):
        fused = cpu_fused.matmul(x, w, fmt, layer, a, b, layer, slots, parts, isa=path_isa)
        apart = cpu.matmul(x, w, fmt, layer, isa=path_isa) + lora_cpu.lora_delta(x, a, b, layer, slots, parts)
        return fused, apart, cpu.matmul(x, w, fmt, layer, isa=path_isa)

    for layer in range(L):
        fused, apart, base = both(x, slots, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(fused), np.asarray(apart))
        none = np.isin(np.asarray(slots), [-1, 5])
        np.testing.assert_array_equal(np.asarray(fused)[none], np.asarray(base)[none])
        assert not np.array_equal(np.asarray(fused)[~none], np.asarray(base)[~none])  # the term is really added


def test_it_applies_only_where_both_kernels_run():
    w, fmt, _ = _case(T.Q4_1, (1, 64, IN))
    x = jnp.zeros((2, IN), jnp.float32)
    a, b = jnp.zeros((1, S, R, IN), jnp.bfloat16), jnp.zeros((1, S, R, 64), jnp.bfloat16)
    assert not cpu_fused.applies(x, fmt, None, a, b)  # float activations: the float kernel's matmul
    assert not cpu_fused.applies(x.astype(jnp.bfloat16), fmt, "avx2", a, b)
    assert not cpu_fused.applies(x, fmt, "avx2", a, b.astype(jnp.float32))  # tables of two dtypes
    assert not cpu_fused.applies(x, dataclasses.replace(fmt, interleaved=True), "avx2", a, b)  # no x16 loops there
    long = jnp.zeros((cpu_fused.MAX_TOKENS + 1, IN), jnp.float32)
    assert cpu_fused.applies(long[:-1], fmt, "avx2", a, b) and not cpu_fused.applies(long, fmt, "avx2", a, b)
