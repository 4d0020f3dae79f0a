"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS): the router's softmax picks each token's top-k
experts; each (token, expert) pair's row runs through its expert's gated MLP (`ExpertLinear`: the rows in pair
order, each by its own expert), and each token's outputs are added back in a fixed order (its k experts by rank),
so a token's output depends on its own routing only, never on which other tokens share the step. Expert weights
are stacked ``[experts, out, in]`` as checkpoints hold each expert's [out, in] (the loader fills the expert axis
from the per-expert tensors), float or kept quantized (a GGUF's blocks). GPT-OSS adds biases to the router and the
experts, and a clamped SwiGLU (`ModelConfig.swiglu_limit`).

How the pairs meet their experts is the kernels': float experts and the quantized reference group the rows by
expert and run a grouped matmul (`pallas_kernels.expert_matmul`: a GEMM per expert on GPU and TPU; on CPU a dense
product over every expert, masked: experts / k times the work); quantized experts on CPU run the grouped int8
kernel, which reads only the routed experts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.kernels import choose_kernels, grouped_quantized_matmul_kernel
from jaxllm.models.layers import Linear, _init, _init_quantized, _scale_axes
from jaxllm.models.stacked_layers import LayerSlice
from pallas_kernels.expert_matmul import expert_matmul
from pallas_kernels.quantized_matmul import QuantFormat, QuantizedWeight


class ExpertLinear(nnx.Module):
    """Every expert's [out, in] weight in one parameter, [experts, out, in]; with ``quant`` kept quantized as
    `jaxllm.models.layers.Linear` keeps a weight (``weight`` the packed values [experts, out, ...],
    ``weight_scale`` and ``weight_offset`` [experts, out, groups]), multiplied by the grouped quantized matmul
    (`jaxllm.kernels.grouped_quantized_matmul_kernel`: on CPU only the routed experts' rows are read)."""

    def __init__(self, experts: int, in_features: int, out_features: int, axes: tuple[str | None, str | None], *,
                 dtype, rngs: nnx.Rngs | None, bias: bool = False, quant: QuantFormat | None = None):
        """axes: logical names of (in, out), as `Linear`'s; bias: each expert's [out] (GPT-OSS)."""
        self.quant = quant
        w_axes = ("expert", axes[1], axes[0])
        if quant is None:
            self.weight = nnx.Param(_init(rngs, (experts, out_features, in_features), dtype, in_features ** -0.5),
                                    axes=w_axes)  # [experts, out, in]
        else:
            parts = [_init_quantized(rngs, quant, out_features, in_features, in_features ** -0.5)
                     for _ in range(experts if rngs is not None else 1)]
            data, scale, offset = (None if p[0] is None else _stack_experts(list(p), experts)
                                   for p in zip(*parts, strict=True))
            self.weight = nnx.Param(data, axes=w_axes)
            self.weight_scale = nnx.Param(scale, axes=("expert", *_scale_axes(w_axes[1:], quant, in_features)))
            self.weight_offset = None if offset is None else nnx.Param(offset, axes=self.weight_scale.axes)
        self.bias = nnx.Param(_init(rngs, (experts, out_features), dtype, 0.02 if rngs is not None else None),
                              axes=("expert", axes[1])) if bias else None  # [experts, out]
        self.kernels = choose_kernels(dtype=dtype)

    def __call__(self, rows: jax.Array, experts: jax.Array) -> jax.Array:
        """rows [R, in], each multiplied by its expert's weight (`experts` [R], any order) -> [R, out]."""
        if self.quant is not None:
            values = [v.get_value() if v is not None else None
                      for v in (self.weight, self.weight_scale, self.weight_offset)]
            matmul = grouped_quantized_matmul_kernel(self.kernels)
            if isinstance(values[0], LayerSlice):  # a layer of the scanned stack: read in place
                w = QuantizedWeight(*(None if v is None else v.stacked for v in values))
                y = matmul(rows, w, self.quant, experts, values[0].index).astype(jnp.float32)
            else:
                y = matmul(rows, QuantizedWeight(*values), self.quant, experts).astype(jnp.float32)
        else:
            y = expert_matmul(rows, self.weight[...], experts)
        if self.bias is not None:
            y = y + self.bias[...][experts].astype(jnp.float32)
        return y.astype(rows.dtype)


def _stack_experts(values: list, experts: int):
    """One expert's quantized arrays (or shapes) -> [experts, ...]: random ones stacked, shapes given the axis."""
    if isinstance(values[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((experts, *values[0].shape), values[0].dtype)
    return jnp.stack(values)


class Experts(nnx.Module):
    """The experts' gated MLPs: gate/up rows interleaved ``[mlp, 2]`` as the dense MLP's."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None, quant: dict | None = None):
        """quant: the model's quantization plan (`experts.gate_up_proj`, `experts.down_proj` its roles here)."""
        n, e, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        quant, bias = quant or {}, cfg.moe_bias
        # "expert_mlp": an expert's rows, split over tp as a dense MLP's, or whole (`jaxllm.sharding`)
        self.gate_up_proj = ExpertLinear(n, e, 2 * f, ("embed", "expert_mlp"), dtype=dtype, rngs=rngs, bias=bias,
                                         quant=quant.get("experts.gate_up_proj"))
        self.down_proj = ExpertLinear(n, f, e, ("expert_mlp", "embed"), dtype=dtype, rngs=rngs, bias=bias,
                                      quant=quant.get("experts.down_proj"))


class MoE(nnx.Module):
    """A decoder layer's MLP (`FamilySpec.mlp`): `gate` is the router, `experts` the stacked experts, and with a
    shared expert (`ModelConfig.shared_expert_intermediate_size`) `shared_expert` and its `shared_expert_gate`."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None, quant: dict | None = None):
        from jaxllm.models.llama import MLP

        e = cfg.hidden_size
        self.gate = Linear(e, cfg.num_experts, ("embed", None), bias=cfg.moe_bias, dtype=dtype,
                           rngs=rngs)  # [experts, embed]
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs, quant=quant)
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.activation = cfg.activation
        self.swiglu_limit, self.swiglu_alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        if cfg.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared, dtype=dtype, rngs=rngs)
            self.shared_expert_gate = Linear(e, 1, ("embed", None), dtype=dtype, rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, E] -> (weights [N, k] float32, experts [N, k] int32): each token's best experts, best first."""
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)  # [N, experts]
        weights, experts = _top_k(probs, self.top_k)
        if self.renormalise:
            weights = weights / _sum_in_order(weights)[:, None]
        return weights, experts

    def __call__(self, x: jax.Array) -> jax.Array:
        lead, e = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, e)  # [N, E]
        n, k = flat.shape[0], self.top_k
        weights, experts = self.route(flat)
        pairs = experts.reshape(-1)  # [N * k]: token t's rank-j expert at t * k + j
        rows = jnp.repeat(flat, k, axis=0)  # [N * k, E], pair order
        gate_up = self.experts.gate_up_proj(rows, pairs).reshape(n * k, -1, 2)  # [N * k, mlp, 2]
        hidden = self._gated(gate_up[..., 0], gate_up[..., 1])
        out = self.experts.down_proj(hidden, pairs).reshape(n, k, e)
        y = weights[:, 0, None] * out[:, 0].astype(jnp.float32)
        for j in range(1, k):  # a fixed order: a token's sum never depends on its neighbours
            y = y + weights[:, j, None] * out[:, j].astype(jnp.float32)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(flat).astype(jnp.float32)) * \
                self.shared_expert(flat).astype(jnp.float32)
        return y.astype(x.dtype).reshape(*lead, e)

    def _gated(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        from jaxllm.models.llama import activate

        if self.swiglu_limit is None:
            return activate(gate, self.activation) * up
        limit = self.swiglu_limit  # GPT-OSS's clamped SwiGLU
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return gate * jax.nn.sigmoid(gate * self.swiglu_alpha) * (up + 1)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x [N, n] -> (values, indices) [N, k], largest first (the lower index first among equal values): k argmax
    passes. `jax.lax.top_k` sorts, and XLA:CPU cannot serialize a sort inside the layers' loop (`LessThan` is not
    serializable), which the engine's executable cache needs."""
    values, indices = [], []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1)  # [N]
        values.append(jnp.take_along_axis(x, i[:, None], axis=-1)[:, 0])
        indices.append(i.astype(jnp.int32))
        x = jnp.where(jnp.arange(x.shape[-1]) == i[:, None], -jnp.inf, x)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def _sum_in_order(x: jax.Array) -> jax.Array:
    """x [N, k] -> [N]: the sum over k, left to right."""
    total = x[:, 0]
    for j in range(1, x.shape[1]):
        total = total + x[:, j]
    return total
