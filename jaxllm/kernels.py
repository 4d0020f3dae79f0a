"""Which implementation runs each kernel op: one decision, made once, for a target platform.

`choose_kernels` turns the requested settings (``attn_impl``, ``matmul_impl``: a name or "auto") into a
`Kernels` for the platform the step will run on (default: this process's backend), so that a CPU host can build
the step a TPU or GPU runs, with the native kernels. Every rule lives here:

- "auto" attention: ``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU, the numba ``cpu`` kernel on CPU for float32,
  float16 and bfloat16 caches, the jnp ``reference`` otherwise; "auto" matmul: the ``cpu`` kernel on CPU for
  float32, the ``pallas_gpu`` skinny matmul on GPU for bfloat16 and float16 weights (decode steps of at most
  `pallas_kernels.skinny_matmul.gpu.MAX_ROWS` rows; XLA's GEMM for more) on one device (GSPMD cannot split a
  Pallas call's rows), else XLA's dot. The ``cpu`` matmul multiplies quantized weights by int8 activations with
  the widest integer dot product the host has (`pallas_kernels.quantized_matmul.isa`; ``JAXLLM_CPU_INT8_ISA=none``:
  float activations).
- Tensor parallelism on CPU takes the references: the CPU kernels are opaque custom calls that GSPMD cannot
  split by heads or rows.
- A Pallas kernel off its own platform runs in Pallas' interpreter (how the CPU test suite runs them);
  ``interpret=False`` forces the native kernel, which only lowers (e.g. for `jax.export` to that platform).
- A CPU kernel asked for another platform, or for a cache dtype it does not handle, is an error, not a fallback.
- The layer loop of a stacked model: unrolled on GPU (XLA:GPU fuses a static slice of a stacked weight into the
  GEMM that reads it, but copies a scan's dynamic slice out first: three HBM crossings of every weight a step;
  `benchmarks/gpu_hlo_report.py` shows both), a scan elsewhere (one layer to trace and compile; the CPU matmul
  kernels read the stacked weight in place, and XLA:TPU fuses the dynamic slice into the dot's operand).
- A row's sum (RMSNorm's mean square) in an order fixed by the row's length on CPU (`Kernels.fixed_order_sums`):
  XLA:CPU picks a reduction's order by the array's shape, so a row's norm would depend on how many rows its step
  has. On GPU the fixed order's slice-adds cost an 8B step 33 (batch 1) to 130 (batch 256) more kernels, so XLA
  reduces there (one kernel a row); whether its order is row-count invariant, as speculative decoding's exactness
  needs, is not checked yet.
- Under tensor parallelism a kernel GSPMD cannot partition (a Pallas kernel: "Mosaic kernels cannot be
  automatically partitioned") runs inside `jax.shard_map` over the mesh's ``tp`` axis, each device on its own
  KV heads; the jnp reference is left to GSPMD.

The model stores the `Kernels` (static: part of its graph definition) and gets its callables from
`attention_kernel` and `matmul_kernel`; the kernels themselves never look at the backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxllm.sharding import TP_AXIS
from pallas_kernels.quantized_matmul import isa as int8_isa
from pallas_kernels.ragged_paged_attention.cpu import CACHE_DTYPES as CPU_CACHE_DTYPES

ATTENTION_IMPLS = ("auto", "reference", "cpu", "pallas_tpu", "pallas_gpu")
MATMUL_IMPLS = ("auto", "reference", "cpu", "pallas_gpu")
LAYER_LOOPS = ("auto", "scan", "unrolled")
PLATFORMS = ("cpu", "tpu", "gpu")
_NATIVE = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "cpu": "cpu"}


def normalize_platform(platform: str) -> str:
    """jax.export's names ("cuda", "rocm") and the backends' ("gpu") -> one of PLATFORMS."""
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform.lower(), platform.lower())
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; choose one of {PLATFORMS} (or cuda, rocm)")
    return platform


@dataclasses.dataclass(frozen=True)
class Kernels:
    attention: str  # reference | cpu | pallas_tpu | pallas_gpu
    matmul: str  # reference | cpu
    platform: str  # the platform the step is built for
    interpret: bool = False  # the Pallas kernels in the interpreter (off their platform)
    mesh: Mesh | None = None  # with a tp axis of more than one device: the attention kernel runs per device
    layer_loop: str = "scan"  # scan | unrolled: how a stacked model runs its layers
    int8_isa: str | None = None  # the cpu quantized matmul's integer path (activations in int8); None: float

    def __post_init__(self):
        if (self.attention not in ATTENTION_IMPLS[1:] or self.matmul not in MATMUL_IMPLS[1:]
                or self.layer_loop not in LAYER_LOOPS[1:] or self.int8_isa not in (None, *int8_isa.ISAS)):
            raise ValueError(f"Kernels holds chosen implementations, not {self.attention!r} / {self.matmul!r} / "
                             f"{self.layer_loop!r} / {self.int8_isa!r}")
        if self.int8_isa is not None and self.matmul != "cpu":
            raise ValueError("an int8 path is the cpu matmul's")
        normalize_platform(self.platform)

    @property
    def fixed_order_sums(self) -> bool:
        """Row sums in an order fixed by the row's length (`jaxllm.models.layers.row_sum`), not XLA's."""
        return normalize_platform(self.platform) == "cpu"


def choose_kernels(attn_impl: str = "auto", matmul_impl: str = "auto", *, platform: str | None = None,
                   dtype=jnp.float32, kv_dtype=None, tensor_parallel_size: int = 1, interpret: bool | None = None,
                   mesh: Mesh | None = None, layer_loop: str = "auto") -> Kernels:
    """The kernels for a step on `platform` (default: the current backend) with weights of `dtype` and a KV cache
    of `kv_dtype` (default: `dtype`), over all of `mesh`'s devices or
    `tensor_parallel_size` devices.
    interpret: None = a Pallas kernel is interpreted exactly when `platform` is not its own.
    layer_loop: "auto" = unrolled on GPU, a scan elsewhere."""
    devices = tensor_parallel_size if mesh is None else mesh.size  # an expert-parallel mesh is tp x ep
    if attn_impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention implementation {attn_impl!r}; choose one of {ATTENTION_IMPLS}")
    if matmul_impl not in MATMUL_IMPLS:
        raise ValueError(f"unknown matmul implementation {matmul_impl!r}; choose one of {MATMUL_IMPLS}")
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"unknown layer loop {layer_loop!r}; choose one of {LAYER_LOOPS}")
    platform = normalize_platform(platform or jax.default_backend())
    if layer_loop == "auto":
        layer_loop = "unrolled" if platform == "gpu" else "scan"
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    cpu_kernels = platform == "cpu" and devices == 1
    if attn_impl == "auto":
        cpu_attention = cpu_kernels and kv_dtype in CPU_CACHE_DTYPES
        attn_impl = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "cpu" if cpu_attention else "reference")
    if matmul_impl == "auto":
        if platform == "gpu" and devices == 1 and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
            matmul_impl = "pallas_gpu"
        else:
            matmul_impl = "cpu" if cpu_kernels and jnp.dtype(dtype) == jnp.float32 else "reference"
    for name, impl in (("attention", attn_impl), ("matmul", matmul_impl)):
        if impl == "cpu" and platform != "cpu":
            raise ValueError(f"the cpu {name} kernel runs on CPU only, not on {platform}")
    if attn_impl == "cpu" and kv_dtype not in CPU_CACHE_DTYPES:
        raise ValueError(f"the cpu attention kernel reads float32, float16 or bfloat16 caches, not {kv_dtype.name}")
    if interpret is None:
        interpret = any(impl in ("pallas_tpu", "pallas_gpu") and _NATIVE[impl] != platform
                        for impl in (attn_impl, matmul_impl))
    # the integer path of this host (the step runs where it is built: the cpu kernels run on CPU only)
    isa = int8_isa.best() if matmul_impl == "cpu" else None
    return Kernels(attn_impl, matmul_impl, platform, interpret, mesh if devices > 1 else None,
                   layer_loop, isa)


def _write_then(attention: Callable) -> Callable:
    """A kernel that only reads the cache, preceded by the scatter of the step's K/V into it."""
    from pallas_kernels.kv_cache import write_kv

    def step(q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables, query_start_loc, **options):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slot_mapping)
        out = attention(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, **options)
        return out, k_cache, v_cache
    return step


def _per_device(step: Callable, mesh: Mesh) -> Callable:
    """`step` on each device's own KV heads: q, k, v split on their head axis, the caches on their leading KV-head
    axis (as `jaxllm.sharding` places them), the metadata replicated."""
    heads, cache, whole = P(None, TP_AXIS, None), P(TP_AXIS, None, None, None), P()

    def run(q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables, query_start_loc, *,
            sliding_window=None, sinks=None, **options):
        # The window and the sinks may be a layer's traced values: inputs of their own (the window replicated,
        # the sinks split with their heads), not closed-over tracers.
        extra = {name: value for name, value in (("sliding_window", sliding_window), ("sinks", sinks))
                 if value is not None}
        if "sliding_window" in extra:
            extra["sliding_window"] = jnp.asarray(sliding_window, jnp.int32)
        names = tuple(extra)

        def body(*args):
            return step(*args[:9], **dict(zip(names, args[9:], strict=True)), **options)
        # check_vma off: a Pallas call inside shard_map does not declare how its outputs vary over the mesh.
        specs = {"sliding_window": whole, "sinks": P(TP_AXIS)}
        per_device = jax.shard_map(body, mesh=mesh, check_vma=False,
                                   in_specs=(heads, heads, heads, cache, cache, whole, whole, whole, whole) +
                                   tuple(specs[name] for name in names), out_specs=(heads, cache, cache))
        return per_device(q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables, query_start_loc,
                          *extra.values())
    return run


@functools.cache
def attention_kernel(kernels: Kernels) -> Callable:
    """The paged attention step: ``(q, k, v, k_cache, v_cache, slot_mapping, kv_lens, block_tables,
    query_start_loc, *, sm_scale, sliding_window, soft_cap, sinks) -> (out, k_cache, v_cache)``: writes the step's
    K/V into the cache, then attends."""
    if kernels.attention == "reference":
        from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
        return _write_then(ragged_paged_attention)
    if kernels.attention == "cpu":  # one custom call writes the cache in place and attends
        from pallas_kernels.ragged_paged_attention.cpu import register, write_and_attend
        if jax.default_backend() == "cpu":
            register()  # now, not when first traced: a step loaded from the executable cache is never traced
        return write_and_attend
    if kernels.attention == "pallas_tpu":
        from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention
    else:
        from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention
    step = _write_then(functools.partial(ragged_paged_attention, interpret=kernels.interpret))
    return step if kernels.mesh is None else _per_device(step, kernels.mesh)


@functools.cache
def matmul_kernel(kernels: Kernels) -> Callable:
    """``(x [..., in], w [out, in]) -> [..., out]``, or ``(x, w [layers, out, in], layer) -> x @ w[layer].T``:
    "reference" is XLA's dot; "cpu" and "pallas_gpu" the kernels for matmuls of few rows (they run XLA's dot
    themselves for more)."""
    if kernels.matmul == "pallas_gpu":
        from pallas_kernels.skinny_matmul.gpu import matmul
        return functools.partial(matmul, interpret=kernels.interpret)
    if kernels.matmul == "cpu":
        from pallas_kernels.skinny_matmul.cpu import matmul, register
        if jax.default_backend() == "cpu":
            register()  # now, not when first traced: a step loaded from the executable cache is never traced
        return matmul
    from pallas_kernels.skinny_matmul.reference import matmul
    return matmul


@functools.cache
def quantized_matmul_kernel(kernels: Kernels) -> Callable:
    """``(x [..., in], w: QuantizedWeight, fmt, layer=None) -> [..., out]``, the matmul against quantized weights
    (`pallas_kernels.quantized_matmul`): with the "cpu" matmul, the CPU kernel (every step shape; on int8
    activations with the host's integer path, `Kernels.int8_isa`); otherwise the reference, XLA's dot on weights
    dequantized in the step (fused on GPU and TPU)."""
    if kernels.matmul == "cpu":
        from pallas_kernels.quantized_matmul.cpu import matmul, register
        if jax.default_backend() == "cpu":
            register(kernels.int8_isa)  # now, not when first traced: a cached step is never traced
        return functools.partial(matmul, isa=kernels.int8_isa)
    from pallas_kernels.quantized_matmul.reference import matmul
    return matmul


@functools.cache
def grouped_quantized_matmul_kernel(kernels: Kernels) -> Callable:
    """``(x [R, in], w: QuantizedWeight [experts, out, ...] (or stacked [layers, experts, ...]), fmt, experts [R]
    (each row's, any order), layer=None) -> [R, out]``, a mixture of experts' projection over quantized experts
    (`pallas_kernels.quantized_matmul`): with the "cpu" matmul and an integer path, the grouped CPU kernel (only the
    routed experts' rows read); otherwise the reference (the experts dequantized in the step, a grouped matmul)."""
    if kernels.matmul == "cpu" and kernels.int8_isa is not None:
        from pallas_kernels.quantized_matmul.cpu import grouped_matmul, register_grouped
        if jax.default_backend() == "cpu":
            register_grouped(kernels.int8_isa)  # now, not when first traced: a cached step is never traced
        return functools.partial(grouped_matmul, isa=kernels.int8_isa)
    from pallas_kernels.quantized_matmul.reference import grouped_matmul
    return grouped_matmul
