"""The engine core: owns the model runner, the KV cache, the block manager and the scheduler, and turns
scheduled steps into per-request outputs. `step()` is synchronous; `EngineLoop` runs it in a thread."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError
from jaxllm.dtypes import resolve_kv_cache_dtype
from jaxllm.engine import compile_monitor, multihost, prompt_logprobs
from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.encoder_cache import EncoderCache
from jaxllm.engine.encoder_runner import EncoderRunner, default_encoder_buckets
from jaxllm.engine.executable_cache import ExecutableCache
from jaxllm.engine.frontend import Frontend, PreparedPrompt
from jaxllm.engine.model_runner import ModelRunner, StepResult
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Request, Sequence, SequenceStatus
from jaxllm.engine.startup import StartupReport
from jaxllm.engine.structured_output import GrammarCompiler
from jaxllm.errors import InvalidRequestError, PromptTooLongError
from jaxllm.kernels import CPU_CACHE_DTYPES
from jaxllm.loading import LoadedModel, load_model
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.multimodal.image_processor import ImageProcessorConfig
from jaxllm.multimodal.inputs import MultiModalSpec
from jaxllm.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import CLASSIFY, EMBED, GENERATE, PooledState, Pooling, PoolingParams
from jaxllm.sampling_params import RequestLimits, SamplingParams
from jaxllm.sharding import make_mesh
from jaxllm.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("jaxllm.engine")


def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache, for every compile (by default it skips ones under a second)."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _kv_budget_bytes(fraction: float) -> int:
    """The KV cache's memory: on CPU a fraction of *total* RAM, so the page count (a compiled shape) is the
    same from one start to the next and the persistent compilation cache hits (free RAM drifts by tens of MB
    between starts); only when that would not fit in the RAM free now, a fraction of the free RAM. On an
    accelerator, a fraction of the device memory left after the weights."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        page = os.sysconf("SC_PAGE_SIZE")
        total, free = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
        budget = int(total * fraction)
        if budget > 0.9 * free:
            logger.warning("kv_memory_fraction %.2f of RAM (%.1f GiB) exceeds the free RAM (%.1f GiB): using %.2f of "
                           "the free RAM; the page count will vary between starts", fraction, budget / 2**30,
                           free / 2**30, fraction)
            budget = int(free * fraction)
        return budget
    stats = device.memory_stats() or {}
    return int((stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)) * fraction)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model: LlamaForCausalLM | None = None,
                 tokenizer: Tokenizer | None = None, loaded: LoadedModel | None = None, warmup: bool = True):
        self.config = config = config or EngineConfig()
        multihost.initialize(config.num_hosts, config.host_rank, config.coordinator_address)  # before any backend
        # (Paths and names may differ between hosts; what shapes the compiled steps may not.)
        shared = dataclasses.replace(config, host_rank=0, model=None, compilation_cache_dir=None,
                                     served_model_name=None)
        multihost.check_same_everywhere("engine config", repr((shared, warmup, model is None)).encode())
        enable_compilation_cache(config.compilation_cache_dir)
        start = time.perf_counter()
        # Executables are cached only for models this engine loaded itself: an edited model can differ in ways
        # no cache key sees (see executable_cache).
        executable_cache = None
        # (Nor for multi-host jobs: an executable spanning processes is rebuilt, not deserialized.)
        if config.compilation_cache_dir and model is None and loaded is None and config.num_hosts == 1:
            try:
                executable_cache = ExecutableCache(os.path.join(os.path.expanduser(config.compilation_cache_dir),
                                                                "executables"))
            except OSError as e:
                logger.warning("executable cache off: %s", e)
        if model is None and loaded is None:
            loaded = load_model(config.model, dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size,
                                attn_impl=config.attn_impl, matmul_impl=config.matmul_impl,
                                kv_cache_dtype=config.kv_cache_dtype, quantization=config.quantization,
                                revision=config.revision, download_dir=config.download_dir)
        load_s = time.perf_counter() - start
        self.checkpoint_bytes_read = loaded.bytes_read if loaded is not None else 0
        if loaded is not None:
            model, tokenizer, mesh, name = loaded.model, tokenizer or loaded.tokenizer, loaded.mesh, loaded.name
        else:
            mesh, name = make_mesh(config.tensor_parallel_size), "custom-model"
        if hasattr(model, "arrange_layers") and model.kernels.layer_loop == "unrolled":
            model.arrange_layers()  # separate layers on GPU, as loads are (a model passed in that a caller edits
            # as separate layers on CPU is left as it is)
        self.model, self.tokenizer = model, tokenizer
        self.model_name = config.served_model_name or name
        cfg = model.config
        self.eos_token_ids = tuple(cfg.eos_token_ids) or (tokenizer.eos_token_ids if tokenizer else ())
        # Embedding: with the pooling the config names, else the one a sentence-transformers folder declares (an
        # encoder without either: its [CLS] token, normalized); classifying: with a cross-encoder's head.
        self.causal = getattr(model, "causal", True)
        if config.classifier_tokens:
            model.set_classifier_tokens(self._classifier_ids(model, tokenizer, config.classifier_tokens))
        classifies = getattr(cfg, "num_labels", 0) > 0 or bool(getattr(model, "classifier_token_ids", ()))
        self.pooling = Pooling(config.pooling, config.normalize_embeddings) if config.pooling else \
            (loaded.pooling if loaded is not None else None)
        if self.pooling is None and not self.causal and not classifies:
            self.pooling = Pooling("cls", True)
        if self.pooling is None and config.runner == "pooling" and not classifies:
            self.pooling = Pooling("last", config.normalize_embeddings)  # vLLM's default for a causal model
        if config.runner == "generate" and not self.causal:
            raise ConfigError(f"runner='generate': {name} is an encoder, it cannot generate (runner='pooling')")
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype)
        if model.kernels.attention == "cpu" and jnp.dtype(self.kv_cache_dtype) not in CPU_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={config.kv_cache_dtype}: the model's cpu attention kernel reads "
                              "float32, float16 or bfloat16 caches; build the model with attn_impl='reference'")
        num_pages, self.max_model_len = self._size_kv_cache(model)
        self.mm_spec, encoder, encoder_cache = self._multimodal(model, loaded)
        tasks = ((GENERATE,) if self.causal else ()) + ((EMBED,) if self.pooling is not None else ()) + \
            ((CLASSIFY,) if classifies else ())
        self.limits = RequestLimits(vocab_size=cfg.vocab_size, max_model_len=self.max_model_len, max_n=config.max_n,
                                    hidden_size=cfg.hidden_size, tasks=tasks)
        self.frontend = Frontend(tokenizer, self.limits, self.eos_token_ids, self.model_name,
                                 score_template=config.score_template, mm_spec=self.mm_spec)
        self.block_manager = BlockManager(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, chunked=self.causal,
                                   encoder_cache=encoder_cache, encoder_budget=self.mm_spec.max_image_tokens
                                   if self.mm_spec else 0)
        start = time.perf_counter()
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=config.page_size,
                                  max_model_len=self.max_model_len, buckets=config.buckets(),
                                  eos_token_ids=self.eos_token_ids, mesh=mesh, executable_cache=executable_cache,
                                  kv_cache_dtype=self.kv_cache_dtype, generates=GENERATE in tasks,
                                  pools=tasks != (GENERATE,), encoder=encoder, encoder_cache=encoder_cache)
        self.startup = StartupReport(load_s=load_s, kv_cache_s=time.perf_counter() - start)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        # Counters for metrics.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_failed_requests = 0
        self.requests_total = 0
        compile_monitor.install()
        if warmup:
            before = compile_monitor.snapshot()
            start = time.perf_counter()
            self.startup.buckets = self.runner.warmup()
            if encoder is not None:
                encoder.warmup()
            self.startup.warmup_s = time.perf_counter() - start
            after = compile_monitor.snapshot()
            self.startup.xla_cache_hits = after["cache_hits"] - before["cache_hits"]
            logger.info("start-up: %s", self.startup.summary())
        self._leader = None
        self._ahead = None  # a decode step dispatched ahead of the step() call that reads it back
        if config.num_hosts > 1 and config.host_rank == 0:
            self._lead_followers()

    def _multimodal(self, model, loaded: LoadedModel | None):
        """A vision-language model's spec (what requests may send), its encoder runner and encoder cache."""
        if not getattr(model, "multimodal", False):
            return None, None, None
        c = self.config
        if c.num_hosts > 1:
            raise ConfigError("vision-language models run on one host")
        processor = (loaded.image_processor if loaded is not None else None) or ImageProcessorConfig()
        budget = c.encoder_budget or c.max_num_batched_tokens
        pixels = budget * processor.factor ** 2  # an image's tokens are its pixels / factor**2
        processor = dataclasses.replace(processor, max_pixels=min(processor.max_pixels, pixels, c.mm_max_pixels or
                                                                  pixels),
                                        min_pixels=min(processor.min_pixels, pixels, c.mm_max_pixels or pixels))
        vl = model.vl_config
        spec = MultiModalSpec(processor, vl.image_token_id, vl.vision_start_token_id, vl.vision_end_token_id,
                              max_images=c.limit_mm_per_prompt, max_image_tokens=budget)
        encoder = EncoderRunner(model.visual, default_encoder_buckets(budget, min(64, budget)))
        return spec, encoder, EncoderCache(c.encoder_cache_tokens or 4 * budget)

    @staticmethod
    def _classifier_ids(model, tokenizer: Tokenizer | None, tokens: tuple[str, ...]) -> tuple[int, ...]:
        if not getattr(model, "causal", True) or tokenizer is None:
            raise ConfigError("classifier_tokens: a decoder with a tokenizer reads its labels from token logits")
        ids = []
        for t in tokens:
            found = tokenizer.backend.token_to_id(t)
            encoded = tokenizer.encode(t, add_special_tokens=False)
            if found is None and len(encoded) != 1:
                raise ConfigError(f"classifier_tokens: {t!r} is not one token of this tokenizer ({encoded})")
            ids.append(found if found is not None else encoded[0])
        return tuple(ids)

    def _lead_followers(self) -> None:
        """Multi-host rank 0, once every host warmed up the same buckets in the same order (lockstep): wait for the
        followers on the step channel, then send them every step. They are told to stop at `close` (also at
        exit: JAX's own exit handler waits for every host)."""
        c = self.config
        self._leader = multihost.StepLeader(multihost.step_address(c.coordinator_address), c.num_hosts - 1)
        self._leader.wait_for_followers(multihost.INIT_TIMEOUT_S)
        self.runner.lead(self._leader, multihost.StepWatchdog())
        atexit.register(self.close)

    def close(self) -> None:
        """Releases what outlives the engine object: on multi-host rank 0, the follower hosts (they exit)."""
        if self._leader is not None:
            self._leader.stop()
            self._leader.close()
            self._leader = None

    @property
    def step_channel_stats(self) -> dict:
        """Multi-host rank 0: steps sent to the followers, their bytes, and the seconds spent encoding and
        sending them."""
        lead = self._leader
        return {} if lead is None else {"steps": lead.sends, "bytes": lead.sent_bytes, "send_s": lead.send_s}

    @property
    def score_template(self) -> str | None:
        return self.frontend.score_template

    @property
    def warmup_seconds(self) -> float:
        return self.startup.warmup_s

    def _size_kv_cache(self, model: LlamaForCausalLM) -> tuple[int, int]:
        c, cfg = self.config, model.config
        page_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * c.page_size * cfg.head_dim * \
            jnp.dtype(self.kv_cache_dtype).itemsize
        if self.causal:
            num_pages = c.num_pages or max(2, _kv_budget_bytes(c.kv_memory_fraction) // page_bytes)
            max_len = c.max_model_len or cfg.max_position_embeddings
        else:  # an encoder reads no cache: pages for one step's slot mapping, inputs of at most one step
            budget = c.max_num_batched_tokens
            num_pages = -(-budget // c.page_size) + c.max_num_seqs
            max_len = min(c.max_model_len or cfg.max_input_tokens, cfg.max_input_tokens, budget)
        num_pages = multihost.agree_min(num_pages)  # a compiled shape: every host must use the same
        max_len = min(max_len, num_pages * c.page_size)
        logger.info("KV cache: %d pages x %d tokens = %d tokens (%.2f GiB); max_model_len %d; "
                    "maximum concurrency at max_model_len: %.1f", num_pages, c.page_size, num_pages * c.page_size,
                    num_pages * page_bytes / 2**30, max_len, num_pages * c.page_size / max_len)
        return num_pages, max_len

    # -- requests (validation and tokenization: the frontend's, shared by every serve mode)
    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams | None = None,
                       cache_salt: str | None = None, images: list | None = None) -> PreparedPrompt:
        return self.frontend.prepare_prompt(prompt, params, cache_salt, images)

    def check_text_fits(self, text: str) -> None:
        self.frontend.check_text_fits(text)

    @property
    def grammars(self) -> GrammarCompiler:
        return self.frontend.grammars

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | PoolingParams | None = None,
                    on_output: Callable[[RequestOutput | PoolingRequestOutput], None] | None = None, *,
                    prepared: PreparedPrompt | None = None, cache_salt: str | None = None) -> Request:
        """prompt: text or token ids; prepared: the result of prepare_prompt (which also checked cache_salt), when
        already done; cache_salt: requests with different salts never share prefix-cache pages (one per tenant)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text, ids, mm = PreparedPrompt(*(prepared or self.prepare_prompt(prompt, params, cache_salt)))
        seed = getattr(params, "seed", None)
        seed = seed if seed is not None else self._rng.getrandbits(64)
        request = Request(request_id, text, ids, params, seed=seed, on_output=on_output, cache_salt=cache_salt,
                          mm=mm)
        if isinstance(params, PoolingParams):  # validated by prepare_prompt: this engine pools
            seq = Sequence(request, 0, None)
            seq.pooled = PooledState(self.pooling)
            request.seqs.append(seq)
        for i in range(params.n if isinstance(params, SamplingParams) else 0):
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output)
            seq = Sequence(request, i, detok)
            if params.structured_outputs is not None:
                seq.matcher = self.grammars.matcher(params.structured_outputs)  # each choice its own
            request.seqs.append(seq)
        self.requests[request_id] = request
        self.requests_total += 1
        self.prompt_tokens_total += len(ids)
        for seq in request.seqs:
            self.scheduler.add(seq)
        return request

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self._emit(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len({s.request.request_id for s in self.scheduler.waiting})

    # -- the step
    def step(self) -> list[RequestOutput]:
        """Runs one step and returns the outputs it produced. With `async_scheduling`, a step that only decodes has
        its successor (the same sequences, one more token each) dispatched before its own tokens are read back:
        the device computes it while this call turns the tokens into outputs, and the next call reads it back. A
        sequence that finished (or was aborted) meanwhile has that extra token dropped; its pages are free already,
        and the token's KV slot lies past anything the prefix cache registered."""
        if self._ahead is not None:
            pending, self._ahead = self._ahead, None
        else:
            step = self.scheduler.schedule()
            if not step:
                return []
            pending = self.runner.dispatch(step)
        if self._may_look_ahead(pending.step) and (nxt := self.scheduler.lookahead(pending.step)) is not None:
            self._ahead = self.runner.dispatch(nxt, after=pending)
        return self._update(pending.step, self.runner.collect(pending))

    def _may_look_ahead(self, step) -> bool:
        """Whether the decode step after `step` can be built without `step`'s tokens: every sequence decodes one
        token, and nothing it samples with depends on the tokens (penalties read them, a grammar's mask follows
        them, min_tokens' bans end with a count). (A vision-language model's decode steps hold no image tokens, and
        their M-RoPE positions are known ahead.)"""
        if not self.config.async_scheduling or self._leader is not None:
            return False
        going_on = False
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            p = seq.params
            if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or seq.pooled is not None or \
                    seq.matcher is not None or seq.finished or p.uses_penalties or p.logit_bias or \
                    seq.num_output_tokens + 1 < p.min_tokens:
                return False
            going_on |= (p.max_tokens is None or seq.num_output_tokens + 1 < p.max_tokens) and \
                seq.num_tokens + 1 < self.max_model_len
        return going_on

    def _update(self, step, result: StepResult) -> list[RequestOutput]:
        pooled: list[Request] = []
        if result.prompt_logprobs is not None:
            prompt_logprobs.fill(*result.prompt_logprobs, self._token_text)
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new_tokens, strict=True)):
            if seq.finished:  # ended while its step ran (the step before finished or aborted it)
                continue
            start = seq.num_computed_tokens
            seq.num_computed_tokens += n
            self.block_manager.cache_full_pages(seq)
            if seq.pooled is not None:
                seq.pooled.add_chunk(start, *result.pooled[0][i], result.pooled[1][i])
                if seq.num_computed_tokens == seq.num_tokens:  # pooled: its pages are freed now
                    self._finish(seq, "stop", None)
                    pooled.append(seq.request)
        touched = self._append_tokens(result) + pooled
        return [out for request in touched if (out := self._emit(request)) is not None]

    def _append_tokens(self, result: StepResult) -> list[Request]:
        touched: dict[str, Request] = {}
        for i, seq in enumerate(result.seqs):
            if seq.finished:  # its request failed earlier in this loop (another choice's error)
                continue
            try:
                self._append_token(seq, result, i)
            except Exception as e:  # this request's own handling failed: end it, keep the batch going
                self._fail_request(seq.request, e)
            touched[seq.request.request_id] = seq.request
        return list(touched.values())

    def _append_token(self, seq: Sequence, result: StepResult, i: int) -> None:
        token = int(result.tokens[i])
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        p = seq.params
        if seq.logprobs is not None:  # computed only when asked for (as in vLLM)
            logprob = float(result.logprobs[i])
            seq.cumulative_logprob += logprob
            entry = {token: Logprob(logprob, int(result.ranks[i]), self._token_text(token))}
            for rank, (tid, lp) in enumerate(zip(result.top_ids[i][:p.logprobs], result.top_logprobs[i][:p.logprobs],
                                                 strict=True), 1):
                entry.setdefault(int(tid), Logprob(float(lp), rank, self._token_text(int(tid))))
            seq.logprobs.append(entry)
        stop_str = seq.detokenizer.add_token(token)
        done = seq.num_output_tokens >= p.min_tokens
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused a token its own mask allowed: {seq.matcher.get_error()}")
            if seq.matcher.is_stopped():  # the grammar is complete (or EOS ended it): nothing more may follow
                self._finish(seq, "stop", None)
                return
        if done and not p.ignore_eos and token in self.eos_token_ids:
            self._finish(seq, "stop", None)
        elif done and token in p.stop_token_ids:
            self._finish(seq, "stop", token)
        elif done and stop_str is not None:
            self._finish(seq, "stop", stop_str)
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or \
                seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _fail_request(self, request: Request, error: Exception) -> None:
        logger.exception("request %s failed; the other requests go on", request.request_id, exc_info=error)
        request.error = f"{type(error).__name__}: {error}"
        self.num_failed_requests += 1
        for seq in request.seqs:
            if not seq.finished:
                self._finish(seq, "error", None)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else ""

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _emit(self, request: Request) -> RequestOutput | PoolingRequestOutput | None:
        """Builds the request's output and hands it to its callback. If either raises, the request ends (its
        pages freed) and the step goes on for everyone else; None is returned for it."""
        try:
            out = self._pooling_output(request) if isinstance(request.params, PoolingParams) else \
                self._generation_output(request)
            if out.finished:
                self.requests.pop(request.request_id, None)
            if request.on_output:
                request.on_output(out)
            return out
        except Exception as e:
            if request.error is None:
                self._fail_request(request, e)
            self.requests.pop(request.request_id, None)
            return None

    def _pooling_output(self, request: Request) -> PoolingRequestOutput:
        seq = request.seqs[0]
        done = seq.finish_reason == "stop"
        data = PoolingOutput(seq.pooled.result(seq.num_tokens, request.params)) if done else None
        return PoolingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids, data,
                                    request.finished, error=request.error, num_cached_tokens=seq.num_cached_tokens)

    @staticmethod
    def _generation_output(request: Request) -> RequestOutput:
        outputs = [CompletionOutput(
            index=s.index, text=s.detokenizer.visible_text(s.finished), token_ids=s.output_token_ids,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None, logprobs=s.logprobs,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in request.seqs]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, request.finished,
                             num_cached_tokens=request.seqs[0].num_cached_tokens, error=request.error,
                             prompt_logprobs=request.prompt_logprobs)

    def stats(self) -> dict:
        """Read on the engine's own thread; other threads read `EngineLoop.stats`."""
        return {
            "num_requests": len(self.requests),
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_cache_usage": self.block_manager.usage,
            "num_free_pages": self.block_manager.num_free_pages,
            "num_pages": self.block_manager.num_pages,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_failed_requests": self.num_failed_requests,
            "requests_total": self.requests_total,
            "prefix_cache_hit_tokens_total": self.block_manager.prefix_hits,
            "images_encoded_total": cache.encoded if (cache := self.runner.encoder_cache) else 0,
            "encoder_cache_hits_total": cache.hits if cache else 0,
        }


__all__ = ["InvalidRequestError", "LLMEngine", "PromptTooLongError", "SequenceStatus"]
