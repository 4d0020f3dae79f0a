"""Runs one scheduled step on device: pads it to a fixed (tokens, sequences) bucket and calls the step
executable built for that bucket (forward through the paged KV cache, LM head on the rows that need a token,
sampling). A server builds every bucket at start-up (`warmup`), so nothing compiles while serving; a one-shot
run builds a bucket when it first needs it.

Building a bucket: load its executable from the `ExecutableCache` (no trace at all), or trace, lower and
compile it (XLA's compile itself may be a hit in JAX's persistent cache). Builds run concurrently on a few
threads (XLA compiles without the GIL), while the calling thread runs each finished bucket once: a bucket's
first run costs far more than the next ones (XLA:CPU prepares its kernels lazily), and that cost belongs in
start-up, not in a request."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.engine import compile_monitor, prompt_logprobs
from jaxllm.engine.encoder_cache import EncoderCache
from jaxllm.engine.encoder_runner import EncoderRunner
from jaxllm.engine.executable_cache import ExecutableCache, step_key
from jaxllm.engine.sampler import SamplingTensors, sample
from jaxllm.engine.scheduler import ScheduledStep
from jaxllm.engine.sequence import Sequence
from jaxllm.engine.step_options import step_compiler_options
from jaxllm.engine.structured_output import bitmask_width, fill_bitmask
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from jaxllm.sharding import kv_cache_sharding
from pallas_kernels.kv_cache import abstract_kv_cache, allocate_kv_cache

UINT32 = 1 << 32


def _step(graphdef, state_def, generates, pools, params, caches, ids, positions, meta, logit_rows, sampling,
          prompt_targets, images=None):
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    # named scopes reach the compiled program's op metadata: a device profile sorts kernels by them
    with jax.named_scope("model"):
        if images is None:
            hidden, caches = model.forward_paged(ids, positions, caches, meta)
        else:  # a vision-language model: positions [3, T], images [levels, T, E] (each image-pad token's embeddings)
            hidden, caches = model.forward_paged(ids, positions, caches, meta, image_embeds=images)
    s = logit_rows.shape[0]
    if generates:
        with jax.named_scope("logits"):
            logits = model.logits(hidden[logit_rows])  # [S, V]: only the rows that get a token
        with jax.named_scope("sampler"):
            tokens, logprobs, ranks, top_ids, top_logprobs = sample(logits, sampling, model.kernels.platform)
        bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
        # [S, 3 + 2 * MAX_LOGPROBS] i32, `unpack`ed on the host: one transfer a step instead of five
        packed = jnp.concatenate([tokens[:, None], bits(logprobs)[:, None], ranks[:, None], top_ids,
                                  bits(top_logprobs)], axis=1)
        # [T, prompt_logprobs.width] i32: each prompt row's logprob of the next prompt token (a step with none: zeros)
        with jax.named_scope("prompt_logprobs"):
            prompt = prompt_logprobs.compute(model.logits, hidden, prompt_targets, model.config.vocab_size)
    else:  # a model that only pools
        tokens = jnp.zeros((s,), jnp.int32)
        packed = jnp.zeros((s, 3 + 2 * MAX_LOGPROBS), jnp.int32)
        prompt = jnp.zeros((ids.shape[0], prompt_logprobs.width(model.config.vocab_size)), jnp.int32)
    # [T]: row i's token at position i, the ids of a decode step that follows this one with the same sequences
    # (a step dispatched before this one's tokens are read back: see LLMEngine.step)
    t = ids.shape[0]
    next_ids = jnp.zeros((t,), jnp.int32).at[:min(s, t)].set(tokens[:min(s, t)])
    if not pools:  # a model that only generates: the same outputs, none of the work (decode steps stay lean)
        return (caches, packed, jnp.zeros((s, 3, hidden.shape[-1]), jnp.float32), jnp.zeros((s, 0), jnp.float32),
                next_ids, prompt)
    pooled = _pool_chunks(hidden, meta)
    classified = model.classify(pooled) if hasattr(model, "classify") else jnp.zeros((s, 0), jnp.float32)
    return caches, packed, pooled, classified, next_ids, prompt


def _pool_chunks(hidden: jax.Array, meta: AttentionMetadata) -> jax.Array:
    """hidden [T, E], query_start_loc [S + 1] -> [S, 3, E] float32: each sequence's first, last and summed hidden
    state in this step (what pooling needs from a prefill chunk; the host combines chunks). Read back only in a
    step that has pooling requests (as is a classifying model's head on the first: `classified` [S, labels])."""
    qsl = meta.query_start_loc
    t, s = hidden.shape[0], qsl.shape[0] - 1
    h = hidden.astype(jnp.float32)
    total = jax.ops.segment_sum(h, meta.sequence_of_token(t), num_segments=s)  # padding tokens (id s) dropped
    first = h[jnp.clip(qsl[:-1], 0, t - 1)]
    last = h[jnp.clip(qsl[1:] - 1, 0, t - 1)]
    return jnp.stack([first, last, total], axis=1)


def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A step's packed output -> (tokens [S], logprobs [S], ranks [S], top ids [S, k], top logprobs [S, k])."""
    k = (packed.shape[1] - 3) // 2
    floats = packed.view(np.float32)
    return packed[:, 0], floats[:, 1], packed[:, 2], packed[:, 3:3 + k], floats[:, 3 + k:]


@dataclasses.dataclass
class BucketBuild:
    """How one bucket's executable was obtained, and what it cost (seconds)."""
    bucket: tuple[int, int]
    source: str  # "executable cache" or "compiled"
    trace_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0  # XLA compile, or a load from JAX's persistent cache
    load_s: float = 0.0  # deserializing from the executable cache
    first_run_s: float = 0.0  # the warm-up run

    @property
    def build_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s + self.load_s


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


@dataclasses.dataclass
class PendingStep:
    """A step dispatched to the device and not read back yet (`ModelRunner.dispatch` / `collect`)."""
    step: ScheduledStep
    bucket: tuple[int, int]
    rows: list[Sequence]  # the sequences that get a token, in row order
    outputs: list[jax.Array]  # packed sampler output, pooled, classified, next ids, prompt logprobs
    spans: list[prompt_logprobs.Span]  # the rows that score prompt tokens

    @property
    def next_ids(self) -> jax.Array:
        """[T] device array: each row's token, as the ids of a decode step of the same sequences."""
        return self.outputs[3]


@dataclasses.dataclass
class StepResult:
    seqs: list[Sequence]  # sequences that received a token, in order
    tokens: np.ndarray  # [n]
    logprobs: np.ndarray  # [n]
    ranks: np.ndarray  # [n] i32: the sampled token's rank (1: the likeliest)
    top_ids: np.ndarray  # [n, 20]
    top_logprobs: np.ndarray  # [n, 20]
    # Steps with pooling requests: ([len(step.seqs), 3, E] first, last, summed hidden state; [len(step.seqs), labels])
    pooled: tuple[np.ndarray, np.ndarray] | None = None
    # Steps that score prompt tokens: ([T, prompt_logprobs.width] packed rows, the spans they belong to)
    prompt_logprobs: tuple[np.ndarray, list[prompt_logprobs.Span]] | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, *, num_pages: int, page_size: int, max_model_len: int,
                 buckets: list[tuple[int, int]], eos_token_ids: tuple[int, ...], mesh=None,
                 executable_cache: ExecutableCache | None = None, kv_cache_dtype=None, generates: bool = True,
                 pools: bool = True, encoder: EncoderRunner | None = None, encoder_cache: EncoderCache | None = None):
        """kv_cache_dtype: the cache's element type (default: the model's dtype); generates: False for a model
        that only pools (its steps sample nothing); pools: False for a model that only generates (its steps
        compute no pooling outputs); encoder, encoder_cache: a vision-language model's image encoder, run on the
        images a step schedules before the step, and where its outputs are kept."""
        cfg = model.config
        compile_monitor.install()  # builds tell fresh compiles from persistent-cache hits
        graphdef, state = nnx.split(model)
        # The graph definition is bound into the jitted step and the weights passed as a flat list: hashing the
        # graphdef and flattening the nnx state on every call made dispatch 2.9-3.3 ms instead of 0.9 ms.
        self.params, state_def = jax.tree.flatten(state)
        self._graphdef = graphdef
        self._jit = jax.jit(functools.partial(_step, graphdef, state_def, generates, pools), donate_argnums=(1,))
        self._compiler_options = step_compiler_options(model.kernels.platform)
        self.executable_cache = executable_cache
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._build_lock = threading.Lock()  # builds run on a pool; the dict has one writer at a time
        self.builds: dict[tuple[int, int], BucketBuild] = {}
        self._unsaved: dict[tuple[int, int], str] = {}  # bucket -> executable cache key, saved after its first run
        self._pending: dict[tuple[int, int], concurrent.futures.Future] = {}  # builds in progress
        self.build_wait_s = 0.0  # time execute() waited for builds (the engine thread's compile time)
        self.vocab_size = cfg.vocab_size
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.buckets = sorted(buckets)
        self.eos_token_ids = eos_token_ids
        # Logit-bias slots per row: a request's own entries, plus its stop and EOS ids masked before min_tokens.
        self.bias_width = -(-(MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + len(eos_token_ids)) // 8) * 8
        # The cache is allocated after the builds (see `caches`); builds lower against its shape alone.
        cache_args = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim,
                      kv_cache_dtype or model.dtype, kv_cache_sharding(mesh) if mesh is not None else None)
        self._allocate = functools.partial(allocate_kv_cache, *cache_args)
        self._caches: tuple[jax.Array, jax.Array] | None = None
        # Device-resident "nothing to do" inputs, reused so steps without penalties or biases transfer nothing.
        # (Built in numpy and put: jnp.full would compile a computation per shape at every start.)
        put = jax.device_put
        self._no_history = {s: put(np.full((s, max_model_len), -1, np.int32)) for _, s in self.buckets}
        w = self.bias_width
        self._no_bias = {s: (put(np.full((s, w), -1, np.int32)), put(np.zeros((s, w), np.float32)))
                         for _, s in self.buckets}
        self.mask_width = bitmask_width(cfg.vocab_size)
        self._no_mask = {s: put(np.full((s, self.mask_width), -1, np.int32)) for _, s in self.buckets}
        self._no_prompt_targets = {t: put(np.full(t, -1, np.int32)) for t, _ in self.buckets}
        # By name: a multi-host step message refers to them, each host holding its own (jaxllm.engine.multihost).
        self.constants = {f"{kind}/{s}": a for s in self._no_history for kind, a in (
            ("history", self._no_history[s]), ("bias_ids", self._no_bias[s][0]),
            ("bias_values", self._no_bias[s][1]), ("mask", self._no_mask[s]))}
        self.constants |= {f"prompt_targets/{t}": a for t, a in self._no_prompt_targets.items()}
        self.multimodal = getattr(model, "multimodal", False)
        self.encoder, self.encoder_cache = encoder, encoder_cache
        if self.multimodal:  # text-only steps pass these: nothing to transfer
            levels = model.visual.feature_levels
            self._no_images = {t: put(np.zeros((levels, t, cfg.hidden_size), model.dtype)) for t, _ in self.buckets}
        self._treedefs: dict[tuple[int, int], object] = {}
        self._leader = None  # multi-host rank 0: each step's inputs go to the other hosts first
        self._codec = None
        self._watchdog = None
        self.mask_seconds: collections.deque[float] = collections.deque(maxlen=4096)  # grammar mask fills (host)
        # What a build lowers against: shapes, dtypes and shardings only (the caches are donated by every run, so
        # a build on another thread must not touch the arrays themselves).
        self._abstract_params = [_abstract(p) for p in self.params]
        self._abstract_caches = abstract_kv_cache(*cache_args)

    @property
    def caches(self) -> tuple[jax.Array, jax.Array]:
        """The K and V caches, allocated on first use: `warmup` builds every bucket first, so compilation (XLA's
        GPU autotuner takes scratch buffers) never competes with the cache for device memory. A precaution: the
        8B out-of-memory seen on an H100 was allocator fragmentation, not this (see benchmarks/device_check.py)."""
        if self._caches is None:
            self._caches = self._allocate()
        return self._caches

    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        for t, s in self.buckets:
            if t >= num_tokens and s >= num_seqs:
                return t, s
        raise ValueError(f"no bucket holds {num_tokens} tokens / {num_seqs} sequences")

    def build(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        """The executable of `bucket`: built before, loaded from the executable cache, or traced and compiled.
        Thread-safe; a caller asking for a bucket another thread is building waits for that build."""
        with self._build_lock:
            if (done := self._executables.get(bucket)) is not None:
                return done
            pending = self._pending.get(bucket)
            if pending is None:
                pending = self._pending[bucket] = concurrent.futures.Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            compiled = self._build(bucket)
            pending.set_result(compiled)
            return compiled
        except BaseException as e:
            pending.set_exception(e)
            raise
        finally:
            with self._build_lock:
                self._pending.pop(bucket, None)

    def prebuild(self, buckets: list[tuple[int, int]]) -> None:
        """Starts building `buckets` on background threads (a one-shot run knows which shapes it will need: its
        decode bucket then compiles while its prompt runs)."""
        for bucket in dict.fromkeys(buckets):
            threading.Thread(target=self.build, args=(bucket,), name=f"jaxllm-build-{bucket}", daemon=True).start()

    def _build(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        args = (self._abstract_params, self._abstract_caches, *self._inputs(ScheduledStep([], []), bucket)[0])
        key = step_key(self._graphdef, args) if self.executable_cache is not None else None
        start = time.perf_counter()
        compiled = self.executable_cache.load(key) if key is not None else None
        if compiled is not None:
            report = BucketBuild(bucket, "executable cache", load_s=time.perf_counter() - start)
        else:
            traced = self._jit.trace(*args)
            t1 = time.perf_counter()
            lowered = traced.lower()
            t2 = time.perf_counter()
            hits = compile_monitor.thread_cache_hits()
            compiled = lowered.compile(compiler_options=self._compiler_options or None)
            report = BucketBuild(bucket, "compiled", trace_s=t1 - start, lower_s=t2 - t1,
                                 compile_s=time.perf_counter() - t2)
            if compile_monitor.thread_cache_hits() > hits:
                # Re-serializing an executable JAX loaded from its own cache gives one that fails when run in a
                # later process ("Function ... not found"): only fresh compiles are kept.
                key = None
        with self._build_lock:  # build() lets one thread build a bucket: plain assignments
            if key is not None and report.source == "compiled":
                # Saved after its first run: XLA:CPU finishes some kernels only then, and an executable
                # serialized before lacks them (a later process fails with "Function ... not found").
                self._unsaved[bucket] = key
            self._executables[bucket] = compiled
            self.builds[bucket] = report
        return compiled

    def warmup(self, max_workers: int | None = None) -> list[BucketBuild]:
        """Builds every bucket (on up to `max_workers` threads) and runs each once, on this thread, as its build
        finishes, then runs each once. Returns how each bucket was built, in bucket order."""
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
        return [self.builds[b] for b in self.buckets]

    def _sampling_tensors(self, rows: list[Sequence], s: int, ahead: int = 0) -> SamplingTensors:
        f32 = np.zeros(s, np.float32)
        temperature, top_p, min_p = f32.copy(), np.ones(s, np.float32), f32.copy()
        rep, freq, pres = np.ones(s, np.float32), f32.copy(), f32.copy()
        top_k, steps, num_prompt = (np.zeros(s, np.int32) for _ in range(3))
        seeds = np.zeros((s, 2), np.uint32)
        choices = np.zeros(s, np.int32)
        any_penalty = any_filter = any_bias = any_random = any_logprobs = False
        for i, seq in enumerate(rows):
            p = seq.params
            temperature[i] = 0.0 if p.greedy else p.temperature
            top_k[i], top_p[i], min_p[i] = p.top_k, p.top_p, p.min_p
            rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
            seed = seq.request.seed % (1 << 64)
            seeds[i] = (seed % UINT32, seed // UINT32)
            choices[i], steps[i] = seq.index, seq.num_output_tokens + ahead
            num_prompt[i] = seq.num_prompt_tokens
            any_penalty |= p.uses_penalties
            any_filter |= (not p.greedy) and p.uses_filters
            any_random |= not p.greedy
            any_logprobs |= p.logprobs is not None
            any_bias |= bool(p.logit_bias) or seq.num_output_tokens + ahead < p.min_tokens
        if any_penalty:
            history = np.full((s, self.max_model_len), -1, np.int32)
            for i, seq in enumerate(rows):
                if seq.params.uses_penalties:
                    history[i, :seq.num_tokens] = seq.token_ids
        else:
            history = self._no_history[s]
        if any_bias:
            bias_ids = np.full((s, self.bias_width), -1, np.int32)
            bias_values = np.zeros((s, self.bias_width), np.float32)
            for i, seq in enumerate(rows):
                entries = dict(seq.params.logit_bias or {})
                if seq.num_output_tokens + ahead < seq.params.min_tokens:
                    banned = seq.params.stop_token_ids + (() if seq.params.ignore_eos else self.eos_token_ids)
                    entries.update(dict.fromkeys(banned, -np.inf))
                entries = {int(k): v for k, v in entries.items() if 0 <= int(k) < self.vocab_size}
                bias_ids[i, :len(entries)] = list(entries)
                bias_values[i, :len(entries)] = list(entries.values())
        else:
            bias_ids, bias_values = self._no_bias[s]
        constrained = [(seq.matcher, i) for i, seq in enumerate(rows) if seq.matcher is not None]
        if constrained:
            start = time.perf_counter()
            mask = np.full((s, self.mask_width), -1, np.int32)
            fill_bitmask(constrained, mask)
            self.mask_seconds.append(time.perf_counter() - start)
        else:
            mask = self._no_mask[s]
        return SamplingTensors(temperature, top_k, top_p, min_p, rep, freq, pres, seeds, choices, steps, bias_ids,
                               bias_values, history, num_prompt, np.bool_(any_filter), np.bool_(any_penalty),
                               np.bool_(any_random), np.bool_(any_logprobs), mask, np.bool_(bool(constrained)),
                               np.bool_(any_bias))

    def lead(self, leader, watchdog) -> None:
        """Multi-host rank 0: from now on every step's inputs are sent to the follower hosts (`leader`, a
        `multihost.StepLeader`) before it runs, and `watchdog` brackets each step."""
        from jaxllm.engine.multihost import StepCodec

        self._leader, self._codec, self._watchdog = leader, StepCodec(self.constants), watchdog

    def input_treedef(self, bucket: tuple[int, int]):
        """The structure of a step's inputs for `bucket` (the same for every step of it)."""
        if bucket not in self._treedefs:
            self._treedefs[bucket] = jax.tree.structure(self._inputs(ScheduledStep([], []), bucket)[0])
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

    def execute(self, step: ScheduledStep, bucket: tuple[int, int] | None = None) -> StepResult:
        return self.collect(self.dispatch(step, bucket))

    def dispatch(self, step: ScheduledStep, bucket: tuple[int, int] | None = None,
                 after: PendingStep | None = None) -> PendingStep:
        """Starts `step` on the device and returns without waiting for it. after: a step dispatched before, not read
        back yet, whose sequences this step decodes once more (one token each, in the same order): its tokens, on
        the device, are this step's ids, and every sequence is one token further than its host state says."""
        bucket = bucket or (after.bucket if after is not None else self.bucket_for(step.num_tokens, len(step.seqs)))
        inputs, rows, spans = self._inputs(step, bucket, self._image_embeds(step) if self.multimodal and step else None,
                                           ahead=int(after is not None))
        if after is not None:
            inputs = (after.next_ids, *inputs[1:])
        if self._leader is not None:
            self._leader.publish(self._codec, bucket, jax.tree.leaves(inputs))
            self._watchdog.started()
        return PendingStep(step, bucket, rows, self.run_inputs(bucket, inputs), spans)

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
        return StepResult(pending.rows, tokens[:n], logprobs[:n], ranks[:n], top_ids[:n], top_logprobs[:n], pooled,
                          scored)

    def run_inputs(self, bucket: tuple[int, int], inputs: tuple, wait: bool = False) -> list[jax.Array]:
        """Runs `bucket`'s executable on prepared inputs (a follower host gets them from rank 0); returns the
        sampler's packed outputs and the pooling outputs (device arrays; `wait`: once computed)."""
        run = self._executables.get(bucket)
        if run is None:
            start = time.perf_counter()
            run = self.build(bucket)
            self.build_wait_s += time.perf_counter() - start
        self._caches, *out = run(self.params, self.caches, *inputs)
        if wait or bucket in self._unsaved:  # a fresh executable is saved once its first run completed
            jax.block_until_ready(out)
        if self._unsaved:
            self._save_after_first_run(bucket, run)
        return out

    def _save_after_first_run(self, bucket: tuple[int, int], run: jax.stages.Compiled) -> None:
        with self._build_lock:
            key = self._unsaved.pop(bucket, None)
        if key is not None:
            self.executable_cache.save(key, run)

    def _inputs(self, step: ScheduledStep, bucket: tuple[int, int], embeds: dict[bytes, np.ndarray] | None = None,
                ahead: int = 0) -> tuple[tuple, list[Sequence], list[prompt_logprobs.Span]]:
        """The step's host inputs padded to `bucket`: (ids, positions, metadata, logit rows, sampling, prompt
        targets[, images]), the sequences that get a token, in row order, and the rows that score prompt tokens.
        embeds: a vision-language model's image embeddings by image hash (`_image_embeds`); ahead: tokens each
        sequence has beyond its host state (a step dispatched after one not read back yet; its ids come from the
        device)."""
        t, s = bucket
        ids = np.zeros(t, np.int32)
        positions = np.zeros((3, t) if self.multimodal else t, np.int32)
        images = None
        rows: list[Sequence] = []
        logit_rows = np.zeros(s, np.int32)
        at = 0
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            start = seq.num_computed_tokens + ahead
            if not ahead:
                ids[at:at + n] = seq.token_ids[start:start + n]
            mm = seq.request.mm
            if mm is not None:
                positions[:, at:at + n] = mm.position_rows(start, n)
                for im in mm.images_in(start, start + n):
                    if images is None:
                        images = np.zeros(self._no_images[t].shape, self._no_images[t].dtype)
                    a, b = max(start, im.offset), min(start + n, im.end)
                    images[:, at + a - start:at + b - start] = embeds[im.hash][:, a - im.offset:b - im.offset]
            else:
                positions[..., at:at + n] = np.arange(start, start + n)
            at += n
            if start + n == seq.num_tokens + ahead and seq.pooled is None:  # the chunk reaches the end: sample
                logit_rows[len(rows)] = at - 1
                rows.append(seq)
        meta = AttentionMetadata.build(
            query_lens=step.num_new_tokens, context_lens=[q.num_computed_tokens + ahead + n for q, n in
                                                          zip(step.seqs, step.num_new_tokens, strict=True)],
            block_tables=[q.block_table for q in step.seqs], page_size=self.page_size, num_tokens=t,
            num_seqs=s, max_pages_per_seq=self.max_pages_per_seq)
        if not ahead and any(q.request.prompt_logprobs is not None for q in step.seqs):
            targets, spans = prompt_logprobs.targets(step.seqs, step.num_new_tokens, t)
        else:  # nothing to score (every decode step): the device-resident constant, no transfer
            targets, spans = self._no_prompt_targets[t], []
        inputs = (ids, positions, meta, logit_rows, self._sampling_tensors(rows, s, ahead), targets)
        if self.multimodal:
            inputs += (self._no_images[t] if images is None else images,)
        return inputs, rows, spans
