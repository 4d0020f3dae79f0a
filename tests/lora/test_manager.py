"""The LoRA pieces below the engine: an adapter's weights packed into the fused layers' tables give exactly the
per-module LoRA terms; the tables are found among a model's parameters whether its layers are stacked (a scan) or
separate (GPU's unrolled loop) and a slot write lands in that slot only; slots are shared, reused least recently
used first, and refused when every one is held; the host keeps at most max_cpu_loras adapters."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from jaxllm.config import ModelConfig
from jaxllm.engine.sequence import Request, Sequence
from jaxllm.lora.adapter import LoRAAdapter
from jaxllm.lora.layout import pack_layer
from jaxllm.lora.manager import LoRAManager, LoRATables
from jaxllm.lora.request import LoRARequest
from jaxllm.models import lora
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.sampling_params import SamplingParams

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
SHAPES = {"q_proj": (32, 32), "k_proj": (16, 32), "v_proj": (16, 32), "o_proj": (32, 32), "gate_proj": (48, 32),
          "up_proj": (48, 32), "down_proj": (32, 48)}


def _adapter(seed: int, rank: int = 4, modules=tuple(SHAPES)) -> LoRAAdapter:
    rng = np.random.default_rng(seed)
    return LoRAAdapter(f"a{seed}", rank, {
        (layer, m): (rng.standard_normal((rank, SHAPES[m][1])).astype(np.float32),
                     rng.standard_normal((SHAPES[m][0], rank)).astype(np.float32))
        for layer in range(CFG.num_layers) for m in modules})


def _term(packed, linear, x):
    """The model's adapter term of one packed layer, by each of `lora.delta`'s paths (each token's own slot
    gathered: 8 slots for 5 tokens; every slot at once: 1 slot; the CPU kernel), which must agree."""
    a, b = packed[linear]
    slots = np.zeros(len(x), np.int32)
    fused = lora.fused_layout(CFG, linear)
    own = lora.delta(x, np.stack([a] * 8), np.stack([b] * 8), slots, fused)
    every = lora.delta(x, a[None], b[None], slots, fused)
    kernel = lora.delta(x, a[None], b[None], slots, fused, matmul="cpu")  # the CPU kernel
    np.testing.assert_allclose(own, every, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kernel, own, rtol=1e-5, atol=1e-5)
    return np.asarray(own)


def test_packed_tables_give_each_modules_own_term_in_the_fused_layout():
    adapter = _adapter(0, rank=3, modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"))
    x = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
    packed = pack_layer(adapter, CFG, 1, rank=4)
    assert packed["mlp.gate_up_proj"][1].shape == (4, 96)  # [rank, out]: one rank's rows, no block of zeros
    term = {m: x @ a.T @ b.T for (layer, m), (a, b) in adapter.weights.items() if layer == 1 and m != "down_proj"}
    fused = _term(packed, "self_attn.qkv_proj", x).reshape(5, 2, 4, 8)  # [T, kv_heads, group + 2, head_dim]
    np.testing.assert_allclose(fused[:, :, :2].reshape(5, 32), term["q_proj"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(fused[:, :, 2], 0)  # k: not a target
    np.testing.assert_allclose(fused[:, :, 3].reshape(5, 16), term["v_proj"], rtol=1e-5, atol=1e-5)
    gate_up = _term(packed, "mlp.gate_up_proj", x).reshape(5, 48, 2)
    np.testing.assert_allclose(gate_up[..., 0], term["gate_proj"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate_up[..., 1], term["up_proj"], rtol=1e-5, atol=1e-5)
    assert not packed["self_attn.o_proj"][0].any()
    x48 = np.random.default_rng(2).standard_normal((5, 48)).astype(np.float32)
    a_down, b_down = adapter.weights[(1, "down_proj")]
    np.testing.assert_allclose(_term(packed, "mlp.down_proj", x48), x48 @ a_down.T @ b_down.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stacked", [True, False])
def test_tables_are_found_and_a_write_fills_one_slot(stacked):
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    if stacked:
        model.stack_layers()
    lora.enable(model, max_loras=3, max_rank=4)
    assert model.stacked == stacked
    state = nnx.split(model)[1]
    params = jax.tree.leaves(state)
    paths = [jax.tree_util.keystr(k, simple=True, separator=".") for k, _ in
             jax.tree_util.tree_flatten_with_path(state)[0]]
    tables = LoRATables(params, paths)
    assert tables.linears == set(lora.PARTS)
    assert len(tables.entries) == 2 * 4 * (1 if stacked else CFG.num_layers)
    adapter = _adapter(2)
    packed = [pack_layer(adapter, CFG, layer, 4) for layer in range(CFG.num_layers)]
    tables.write(1, packed)
    for i, layer, linear, which in tables.entries:
        value = np.asarray(params[i])
        got = value[:, 1] if layer is None else value[1]  # slot 1
        want = np.stack([p[linear][which == "b"] for p in packed]) if layer is None else packed[layer][linear][
            which == "b"]
        np.testing.assert_array_equal(got, want)
        others = np.delete(value, 1, axis=1 if layer is None else 0)
        assert not others.any()  # slots 0 and 2 untouched


def _seq(request: LoRARequest | None, index: int = 0) -> Sequence:
    req = Request(str(id(request)), None, [1, 2, 3], SamplingParams(), seed=0, lora_request=request)
    return Sequence(req, index, None)


def _save(folder, seed):
    adapter = _adapter(seed)
    tensors = {}
    for (layer, m), (a, b) in adapter.weights.items():
        block = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"base_model.model.model.layers.{layer}.{block}.{m}"
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4, "target_modules": list(SHAPES)}))
    return str(folder)


class _Tables:  # records writes
    linears = set(lora.PARTS)

    def __init__(self):
        self.writes = []

    def write(self, slot, packed):
        self.writes.append(slot)

    def warm_up(self, cfg, rank):
        pass


def test_slots_are_shared_reused_least_recently_used_first_and_refused_when_all_are_held(tmp_path):
    tables = _Tables()
    manager = LoRAManager(CFG, tables, max_loras=2, max_rank=4, max_cpu_loras=3)
    reqs = [LoRARequest(f"r{i}", i + 1, _save(tmp_path / f"r{i}", i)) for i in range(4)]
    a0, a1, b0 = _seq(reqs[0]), _seq(reqs[0], 1), _seq(reqs[1])
    assert manager.acquire(a0) and manager.acquire(a1) and manager.acquire(b0)
    assert a0.lora_slot == a1.lora_slot != b0.lora_slot and len(tables.writes) == 2  # one write per adapter
    c = _seq(reqs[2])
    assert not manager.acquire(c) and c.lora_slot is None  # both slots held
    assert manager.acquire(_seq(None))  # the base model needs no slot
    manager.release(b0)
    assert manager.acquire(c) and c.lora_slot == 1 and len(tables.writes) == 3  # reqs[1]'s slot, written anew
    manager.release(a0)
    manager.release(a1)
    again = _seq(reqs[0])
    assert manager.acquire(again) and again.lora_slot == 0 and len(tables.writes) == 3  # still there: no write
    assert manager.running == {"r0": 1, "r2": 1}
    for r in reqs:  # a fourth adapter on the host: the least recently used one not in a slot (r1) goes
        manager.prepare(r)
    assert set(manager.host) == {1, 3, 4}


def test_one_id_for_two_adapters_is_refused(tmp_path):
    manager = LoRAManager(CFG, _Tables(), max_loras=1, max_rank=4)
    manager.prepare(LoRARequest("x", 1, _save(tmp_path / "x", 0)))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'x'"):
        manager.prepare(LoRARequest("y", 1, _save(tmp_path / "y", 1)))
