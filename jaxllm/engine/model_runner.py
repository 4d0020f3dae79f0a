"""Runs one scheduled step on device: pads it to a fixed (tokens, sequences) bucket and calls the step
executable built for that bucket (`step_function`: forward through the paged KV cache, LM head on the rows that
need a token, sampling). A server builds every bucket at start-up (`warmup`), so nothing compiles while serving; a
one-shot run builds a bucket when it first needs it (`step_executables`).

Warm-up builds buckets concurrently on a few threads while the calling thread runs each finished bucket once: a
bucket's first run costs far more than the next ones (XLA:CPU prepares its kernels lazily), and that cost belongs
in start-up, not in a request."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxllm.engine import compile_monitor, prompt_logprobs
from jaxllm.engine.encoder_cache import EncoderCache
from jaxllm.engine.encoder_runner import EncoderRunner
from jaxllm.engine.executable_cache import ExecutableCache
from jaxllm.engine.input_packing import InputPacker
from jaxllm.engine.sampling_inputs import SamplingInputs
from jaxllm.engine.scheduler import ScheduledStep
from jaxllm.engine.sequence import Sequence
from jaxllm.engine.step_executables import BucketBuild, StepExecutables
from jaxllm.engine.step_function import step_function, unpack
from jaxllm.engine.step_inputs import StepInputBuilder, StepInputs
from jaxllm.engine.step_options import step_compiler_options
from jaxllm.models.protocol import Model
from jaxllm.pooling_params import GENERATE
from jaxllm.sharding import kv_cache_sharding
from jaxllm.speculative import verify
from pallas_kernels.kv_cache import abstract_kv_cache, allocate_kv_cache

__all__ = ["BucketBuild", "ModelRunner", "PendingStep", "StepResult"]


def abstract_array(x: jax.Array) -> jax.ShapeDtypeStruct:
    """What an executable is lowered against for `x`: its shape, dtype and placement."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


@dataclasses.dataclass(frozen=True)
class FeatureCache:
    """The feature cache's shape: a row per KV slot, replicated over a mesh (the residual stream is)."""
    slots: int
    width: int
    dtype: object
    mesh: jax.sharding.Mesh | None

    @property
    def sharding(self) -> jax.sharding.Sharding:
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.slots, self.width), self.dtype, sharding=self.sharding)

    def allocate(self) -> jax.Array:
        shape, sharding = (self.slots, self.width), self.sharding
        if all(d.platform == "cpu" for d in sharding.device_set):  # as the KV cache: numpy's lazily zeroed pages
            return jax.device_put(np.zeros(shape, self.dtype), sharding)
        return jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=sharding)()


def _with_features(allocate_kv, features: FeatureCache) -> tuple[jax.Array, ...]:
    return (*allocate_kv(), features.allocate())


@dataclasses.dataclass
class PendingStep:
    """A step dispatched to the device and not read back yet (`ModelRunner.dispatch` / `collect`)."""
    step: ScheduledStep
    bucket: tuple[int, int]
    rows: list[Sequence]  # the sequences that get a token, in row order
    outputs: list[jax.Array]  # packed sampler output, pooled, classified, next ids, prompt logprobs
    spans: list[prompt_logprobs.Span]  # the rows that score prompt tokens
    samples: list[tuple[int, list[int]]] | None = None  # a step with drafts: per row, its first sample row, drafts

    @property
    def next_ids(self) -> jax.Array:
        """[T] device array: each row's token, as the ids of a decode step of the same sequences."""
        return self.outputs[3]


@dataclasses.dataclass
class StepResult:
    seqs: list[Sequence]  # sequences that received tokens, in order
    tokens: list[list[int]]  # per sequence, the tokens it gets (one per step without speculation)
    logprobs: np.ndarray  # [n, K]: per sequence and sample position (K: 1 + the drafts a sequence may have)
    ranks: np.ndarray  # [n, K] i32: the sampled token's rank (1: the likeliest)
    top_ids: np.ndarray  # [n, K, 20]
    top_logprobs: np.ndarray  # [n, K, 20]
    # Steps with pooling requests: ([len(step.seqs), 3, E] first, last, summed hidden state; [len(step.seqs), labels])
    pooled: tuple[np.ndarray, np.ndarray] | None = None
    # Steps that score prompt tokens: ([T, prompt_logprobs.width] packed rows, the spans they belong to)
    prompt_logprobs: tuple[np.ndarray, list[prompt_logprobs.Span]] | None = None
    # A step with drafts: per sequence of the step (`ScheduledStep.seqs`), its drafts the target rejected
    rejected: list[int] | None = None


class ModelRunner:
    def __init__(self, model: Model, *, num_pages: int, page_size: int, max_model_len: int,
                 buckets: list[tuple[int, int]], eos_token_ids: tuple[int, ...], mesh=None,
                 executable_cache: ExecutableCache | None = None, kv_cache_dtype=None, generates: bool = True,
                 pools: bool = True, encoder: EncoderRunner | None = None, encoder_cache: EncoderCache | None = None,
                 num_speculative_tokens: int = 0, lora: bool = False, capture: tuple[int, ...] = ()):
        """kv_cache_dtype: the cache's element type (default: the model's dtype); generates: False for a model
        that only pools (its steps sample nothing); pools: False for a model that only generates (its steps
        compute no pooling outputs); encoder, encoder_cache: a vision-language model's image encoder, run on the
        images a step schedules before the step, and where its outputs are kept; num_speculative_tokens: the most
        drafts a sequence verifies in one step (0: no speculation); lora: the model has LoRA tables
        (`jaxllm.models.lora`), which `jaxllm.lora.manager.LoRATables` finds among the parameters by their
        `param_paths`; capture: layers whose inputs each step keeps per KV slot, in a feature cache beside the KV
        cache (`step_function`; an EAGLE-3 head reads it: `features`)."""
        cfg = model.config
        compile_monitor.install()  # builds tell fresh compiles from persistent-cache hits
        graphdef, state = nnx.split(model)
        # The graph definition is bound into the jitted step and the weights passed as a flat list: hashing the
        # graphdef and flattening the nnx state on every call made dispatch 2.9-3.3 ms instead of 0.9 ms.
        self.params, state_def = jax.tree.flatten(state)
        self.param_paths = [jax.tree_util.keystr(k, simple=True, separator=".")  # in `params` order
                            for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]] if lora else []
        self.graphdef = graphdef
        self.page_size, self.max_model_len = page_size, max_model_len
        self.buckets = sorted(buckets)
        self.kv_cache_dtype = kv_cache_dtype or model.dtype
        # The cache is allocated after the builds (see `caches`); builds lower against its shape alone.
        cache_args = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim, self.kv_cache_dtype,
                      kv_cache_sharding(mesh) if mesh is not None else None)
        self._allocate = functools.partial(allocate_kv_cache, *cache_args)
        self._caches: tuple[jax.Array, ...] | None = None
        self.capture = tuple(capture)
        feature_cache = FeatureCache(num_pages * page_size, len(capture) * cfg.hidden_size, model.dtype, mesh) \
            if capture else None
        self.multimodal = model.multimodal
        self.encoder, self.encoder_cache = encoder, encoder_cache
        # Device-resident "nothing to do" inputs, reused so that steps without penalties, biases, grammars, prompt
        # logprobs or images transfer none of those.
        self.sampling = SamplingInputs(vocab_size=cfg.vocab_size, max_model_len=max_model_len,
                                       eos_token_ids=eos_token_ids, row_buckets=[s for _, s in self.buckets])
        images = (model.visual.feature_levels, cfg.hidden_size, model.dtype) if self.multimodal else None
        self.inputs = StepInputBuilder(buckets=self.buckets, page_size=page_size, max_model_len=max_model_len,
                                       sampling=self.sampling, images=images,
                                       sample_positions=1 + num_speculative_tokens, lora=lora)
        # By name: a multi-host step message refers to them, each host holding its own (jaxllm.engine.multihost).
        self.constants = self.inputs.constants
        self._treedefs: dict[tuple[int, int], object] = {}
        self._leader = self._codec = self._watchdog = None  # multi-host rank 0: inputs go to the other hosts first
        self.abstract_params = [abstract_array(p) for p in self.params]
        self.abstract_caches = abstract_kv_cache(*cache_args)
        if feature_cache is not None:
            self._allocate = functools.partial(_with_features, self._allocate, feature_cache)
            self.abstract_caches = (*self.abstract_caches, feature_cache.abstract())
        # A step's small host inputs travel as one array (`input_packing`): the step takes them apart.
        self.packer = InputPacker(lambda bucket: self.inputs.build(ScheduledStep([], []), bucket).inputs, self.buckets)
        step = functools.partial(step_function, graphdef, state_def, generates, pools, capture=self.capture)

        def packed_step(params, caches, packed, rest):
            return step(params, caches, self.packer.unpack(packed, rest))
        jitted = jax.jit(packed_step, donate_argnums=(1,))
        # the captured layers are traced into the step but appear in no argument: part of the cache key
        key = (graphdef, self.capture) if capture else graphdef
        self.executables = StepExecutables(jitted, self.abstract_args, key,
                                           step_compiler_options(model.kernels.platform), executable_cache)

    @classmethod
    def from_parts(cls, parts, buckets: list[tuple[int, int]]) -> ModelRunner:
        """The runner of an engine's resolved parts (`engine_parts.EngineParts`)."""
        kv, enc = parts.kv, parts.encoder
        return cls(parts.model, num_pages=kv.num_pages, page_size=kv.page_size, max_model_len=kv.max_model_len,
                   buckets=buckets, eos_token_ids=parts.eos_token_ids, mesh=parts.mesh,
                   executable_cache=parts.executable_cache, kv_cache_dtype=kv.dtype,
                   generates=GENERATE in parts.tasks, pools=parts.tasks != (GENERATE,),
                   encoder=enc.runner if enc else None, encoder_cache=enc.cache if enc else None,
                   num_speculative_tokens=spec.num_speculative_tokens if (spec := parts.speculative) else 0,
                   lora=parts.lora, capture=parts.features)

    @property
    def features(self) -> jax.Array:
        """The feature cache [slots, len(capture) * E] (with `capture`): the captured layers' inputs of every token
        the steps computed, at its KV slot. Read by a method whose drafts follow the target's hidden states."""
        return self.caches[2]

    @property
    def caches(self) -> tuple[jax.Array, ...]:
        """The K and V caches (and the feature cache, with `capture`), allocated on first use: `warmup` builds every
        bucket first, so compilation (XLA's GPU autotuner takes scratch buffers) never competes with the cache for
        device memory. A precaution: the 8B out-of-memory seen on an H100 was allocator fragmentation, not this (see
        benchmarks/device_check.py)."""
        if self._caches is None:
            self._caches = self._allocate()
        return self._caches

    def abstract_args(self, bucket: tuple[int, int]) -> tuple:
        """What the step executable of `bucket` is lowered against: (weights, caches, packed inputs, the other
        inputs), abstract (`input_packing`)."""
        template = self.inputs.build(ScheduledStep([], []), bucket).inputs
        return self.abstract_params, self.abstract_caches, *self.packer.abstract(bucket, template)

    # -- executables (`StepExecutables`)
    @property
    def builds(self) -> dict[tuple[int, int], BucketBuild]:
        return self.executables.builds

    @property
    def build_wait_s(self) -> float:
        return self.executables.build_wait_s

    @property
    def mask_seconds(self):
        return self.sampling.mask_seconds

    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        for t, s in self.buckets:
            if t >= num_tokens and s >= num_seqs:
                return t, s
        raise ValueError(f"no bucket holds {num_tokens} tokens / {num_seqs} sequences")

    def build(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        return self.executables.build(bucket)

    def prebuild(self, buckets: list[tuple[int, int]]) -> None:
        self.executables.prebuild(buckets)

    def warmup(self, max_workers: int | None = None, timed_runs: int = 0) -> list[BucketBuild]:
        """Builds every bucket (on up to `max_workers` threads), then runs each once on this thread, and
        `timed_runs` more times to time a step of it (`BucketBuild.run_s`: speculation's draft budget weighs a
        step's rows by them). Returns how each bucket was built, in bucket order."""
        workers = max_workers or min(len(self.buckets), os.cpu_count() or 1, 4)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxllm-build") as pool:
            futures = [pool.submit(self.build, b) for b in self.buckets]
            with tqdm(total=len(futures), desc="building buckets", unit="bucket") as progress:
                for future in concurrent.futures.as_completed(futures):
                    future.result()
                    progress.update()
        for bucket in self.buckets:  # the cache is allocated by the first run, after every build (see `caches`)
            start = time.perf_counter()
            self.execute(ScheduledStep([], []), bucket=bucket)
            self.builds[bucket].first_run_s = time.perf_counter() - start
            for _ in range(timed_runs):
                start = time.perf_counter()
                self.execute(ScheduledStep([], []), bucket=bucket)
                took = time.perf_counter() - start
                self.builds[bucket].run_s = min(self.builds[bucket].run_s or took, took)
        return [self.builds[b] for b in self.buckets]

    def time_step(self, step: ScheduledStep, runs: int = 3, back_to_back: bool = False) -> float:
        """Seconds a step of `step`'s shape takes: the fastest of `runs`, each read back before the next is
        dispatched (a step that waits for the host's work before it), or with `back_to_back` the period of `runs`
        dispatched one after another before any is read back (decode steps running ahead: async scheduling). The
        step runs as it is, once more to start: its sequences' host state is left alone, its K/V written to their
        pages."""
        bucket = self.bucket_for(step.num_tokens, len(step.seqs))
        self.collect(self.dispatch(step, bucket))
        if back_to_back:
            start = time.perf_counter()
            for pending in [self.dispatch(step, bucket) for _ in range(runs)]:
                self.collect(pending)
            return (time.perf_counter() - start) / runs
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            self.collect(self.dispatch(step, bucket))
            best = min(best, time.perf_counter() - start)
        return best

    def lead(self, leader, watchdog) -> None:
        """Multi-host rank 0: from now on every step's inputs are sent to the follower hosts (`leader`, a
        `multihost.StepLeader`) before it runs, and `watchdog` brackets each step."""
        from jaxllm.engine.multihost import StepCodec

        self._leader, self._codec, self._watchdog = leader, StepCodec(self.constants), watchdog

    def input_treedef(self, bucket: tuple[int, int]):
        """The structure of a step's inputs for `bucket` (the same for every step of it)."""
        if bucket not in self._treedefs:
            self._treedefs[bucket] = jax.tree.structure(self.inputs.build(ScheduledStep([], []), bucket).inputs)
        return self._treedefs[bucket]

    def _image_embeds(self, step: ScheduledStep) -> dict[bytes, np.ndarray]:
        """The embeddings of every image with tokens in the step, by hash: from the encoder cache, or encoded now
        (those the scheduler put in `step.encode`)."""
        found: dict[bytes, np.ndarray] = {}
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            if seq.request.mm is not None:
                for im in seq.request.mm.images_in(seq.num_computed_tokens, seq.num_computed_tokens + n):
                    if im.hash not in found and (rows := self.encoder_cache.get(im.hash)) is not None:
                        found[im.hash] = rows
        todo = list({im.hash: im for im in step.encode if im.hash not in found}.values())
        if todo:
            for im, rows in zip(todo, self.encoder.encode(todo), strict=True):
                self.encoder_cache.put(im.hash, rows)
                found[im.hash] = rows
        return found

    # -- steps
    def execute(self, step: ScheduledStep, bucket: tuple[int, int] | None = None) -> StepResult:
        return self.collect(self.dispatch(step, bucket))

    def dispatch(self, step: ScheduledStep, bucket: tuple[int, int] | None = None,
                 after: PendingStep | None = None, assumed: list[list[int]] | None = None) -> PendingStep:
        """Starts `step` on the device and returns without waiting for it. after: a step dispatched before, not read
        back yet, whose sequences this step decodes once more (one token each, in the same order): its tokens, on
        the device, are this step's ids, and every sequence is one token further than its host state says.
        assumed: per sequence, the tokens it is taken to have beyond its host state (a guessed step's; the host
        knows its ids)."""
        bucket = bucket or (after.bucket if after is not None else self.bucket_for(step.num_tokens, len(step.seqs)))
        built = self.inputs.build(step, bucket, self._image_embeds(step) if self.multimodal and step else None,
                                  ahead=int(after is not None), assumed=assumed)
        inputs = built.inputs if after is None else dataclasses.replace(built.inputs, ids=after.next_ids)
        if self._leader is not None:
            self._leader.publish(self._codec, bucket, jax.tree.leaves(inputs))
            self._watchdog.started()
        return PendingStep(step, bucket, built.rows, self.run_inputs(bucket, inputs), built.spans, built.samples)

    def collect(self, pending: PendingStep) -> StepResult:
        """Waits for a dispatched step and reads back what the host needs of it."""
        out, pooled, classified, _, prompt = pending.outputs
        tokens, logprobs, ranks, top_ids, top_logprobs = unpack(np.asarray(out))
        seqs = pending.step.seqs
        if any(q.pooled is not None for q in seqs):
            pooled = (np.asarray(pooled)[:len(seqs)], np.asarray(classified)[:len(seqs)])
        else:
            pooled = None
        if self._watchdog is not None:
            self._watchdog.finished()
        n = len(pending.rows)
        scored = (np.asarray(prompt), pending.spans) if pending.spans else None
        if pending.samples is None:  # row i sampled once, at sample row i
            index = np.arange(n)[:, None]
            accepted, rejected = [[int(t)] for t in tokens[:n]], None
        else:  # each row's samples verify its drafts (`jaxllm.speculative.verify`)
            index = np.zeros((n, self.inputs.sample_positions), np.int64)
            accepted, rejected_of = [], {}
            for i, (seq, (first, drafted)) in enumerate(zip(pending.rows, pending.samples, strict=True)):
                m = 1 + len(drafted)
                index[i] = first + np.minimum(np.arange(index.shape[1]), m - 1)
                accepted.append(got := verify.accepted(tokens[first:first + m], drafted))
                rejected_of[seq.seq_id] = len(drafted) + 1 - len(got)
            rejected = [rejected_of.get(q.seq_id, 0) for q in seqs]
        return StepResult(pending.rows, accepted, logprobs[index], ranks[index], top_ids[index], top_logprobs[index],
                          pooled, scored, rejected)

    def run_inputs(self, bucket: tuple[int, int], inputs: StepInputs, wait: bool = False) -> list[jax.Array]:
        """Runs `bucket`'s executable on prepared inputs (a follower host gets them from rank 0); returns the
        sampler's packed outputs and the pooling outputs (device arrays; `wait`: once computed)."""
        run = self.executables.get(bucket)
        self._caches, *out = run(self.params, self.caches, *self.packer.pack(bucket, inputs))
        if wait or self.executables.first_run_pending(bucket):  # a fresh executable is saved after its first run
            jax.block_until_ready(out)
            self.executables.saved_after_run(bucket)
        return out
