"""The engine core: owns the model runner, the KV cache, the block manager and the scheduler, and turns
scheduled steps into per-request outputs. `step()` is synchronous; `EngineLoop` runs it in a thread. What the
engine is made of is resolved by `engine_parts`; when a sequence stops, by `stop_checker`; what a request's
output holds, by `request_outputs`."""

from __future__ import annotations

import atexit
import logging
import random
import time
from collections.abc import Callable

from jaxllm.dtypes import resolve_kv_cache_dtype
from jaxllm.engine import compile_monitor, multihost, prompt_logprobs
from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.engine_parts import EngineParts, resolve_engine_parts
from jaxllm.engine.frontend import Frontend, PreparedPrompt
from jaxllm.engine.model_runner import ModelRunner, StepResult
from jaxllm.engine.request_outputs import generation_output, pooling_output
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.sequence import Request, Sequence, SequenceStatus
from jaxllm.engine.startup import StartupReport
from jaxllm.engine.stop_checker import check_stop, stops_by_id
from jaxllm.engine.structured_output import GrammarCompiler
from jaxllm.errors import InvalidRequestError, PromptTooLongError
from jaxllm.loading import LoadedModel
from jaxllm.lora.request import LoRARequest
from jaxllm.models.protocol import Model
from jaxllm.outputs import Logprob, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PooledState, PoolingParams
from jaxllm.sampling_params import SamplingParams
from jaxllm.speculative import Drafter
from jaxllm.speculative.methods import ProposerContext
from jaxllm.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("jaxllm.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model: Model | None = None,
                 tokenizer: Tokenizer | None = None, loaded: LoadedModel | None = None, warmup: bool = True):
        """model (with tokenizer), or loaded: what to serve instead of loading `config.model` (an edited model)."""
        self.config = config = config or EngineConfig()
        parts = resolve_engine_parts(config, model=model, tokenizer=tokenizer, loaded=loaded, warmup=warmup)
        self.model, self.tokenizer, self.model_name = parts.model, parts.tokenizer, parts.model_name
        self.eos_token_ids, self.pooling, self.limits = parts.eos_token_ids, parts.pooling, parts.limits
        self.checkpoint_bytes_read = parts.checkpoint_bytes_read
        self.mm_spec = parts.encoder.spec if parts.encoder else None
        self.block_manager = BlockManager(parts.kv.num_pages, parts.kv.page_size, config.enable_prefix_caching)
        start = time.perf_counter()
        self.runner = ModelRunner.from_parts(parts, config.buckets())
        self.drafter = None
        if parts.speculative is not None:
            kv = parts.kv
            draft_kv = resolve_kv_cache_dtype(config.kv_cache_dtype, parts.draft.dtype) if parts.draft else None
            features = (lambda: self.runner.features) if parts.features else None
            context = ProposerContext(kv.max_model_len, kv.page_size, kv.num_pages, tuple(config.buckets()),
                                      parts.draft, draft_kv, parts.mesh, features)
            self.drafter = Drafter(parts.speculative, kv.max_model_len, context)
        self.loras = None  # jaxllm.lora.LoRAManager of an engine with adapters: their slots in the runner's tables
        if parts.lora:
            from jaxllm.lora.manager import LoRAManager, LoRATables

            tables = LoRATables(self.runner.params, self.runner.param_paths)
            self.loras = LoRAManager(self.model.config, tables, max_loras=config.max_loras,
                                     max_rank=config.max_lora_rank, max_cpu_loras=config.max_cpu_loras)
        self.frontend = Frontend(self.tokenizer, self.limits, self.eos_token_ids, self.model_name,
                                 score_template=config.score_template, mm_spec=self.mm_spec,
                                 lora_spec=self.loras.spec if self.loras else None)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, chunked=self.causal,
                                   encoder_cache=parts.encoder.cache if parts.encoder else None,
                                   encoder_budget=self.mm_spec.max_image_tokens if self.mm_spec else 0,
                                   loras=self.loras)
        self.startup = StartupReport(load_s=parts.load_s, kv_cache_s=time.perf_counter() - start)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self.prompt_tokens_total = self.generation_tokens_total = 0  # counters for metrics
        self.num_failed_requests = self.requests_total = 0
        compile_monitor.install()
        if warmup:
            self._warmup(parts)
        self._leader = None
        self._ahead = None  # a decode step dispatched ahead of the step() call that reads it back
        self._guessed = None  # when that step is a guess (`_guess_ahead`): per sequence, what it must hold
        if config.num_hosts > 1 and config.host_rank == 0:
            self._lead_followers()

    def _warmup(self, parts: EngineParts) -> None:
        before = compile_monitor.snapshot()
        start = time.perf_counter()
        budget = self.drafter is not None and self.drafter.config.draft_budget == "step_cost"
        self.startup.buckets = self.runner.warmup(timed_runs=2 if budget else 0)
        if self.drafter is not None:
            self.drafter.proposer.warmup()
            self.drafter.calibrate({b.bucket: b.run_s for b in self.startup.buckets}, self.runner.bucket_for,
                                   overlap=self.config.async_scheduling)
            self.drafter.limit_batches(self.runner, self.config.max_num_seqs)
        if parts.encoder is not None:
            parts.encoder.runner.warmup()
        self.startup.warmup_s = time.perf_counter() - start
        self.startup.xla_cache_hits = compile_monitor.snapshot()["cache_hits"] - before["cache_hits"]
        logger.info("start-up: %s", self.startup.summary())

    @property
    def causal(self) -> bool:
        return self.model.causal

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def kv_cache_dtype(self):
        return self.runner.kv_cache_dtype

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
                    prepared: PreparedPrompt | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """prompt: text or token ids; prepared: the result of prepare_prompt (which also checked cache_salt), when
        already done; cache_salt: requests with different salts never share prefix-cache pages (one per tenant);
        lora_request: the `jaxllm.lora.LoRARequest` it runs with (an engine with enable_lora)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.prepare_lora(lora_request)
        text, ids, mm = PreparedPrompt(*(prepared or self.prepare_prompt(prompt, params, cache_salt)))
        seed = getattr(params, "seed", None)
        seed = seed if seed is not None else self._rng.getrandbits(64)
        request = Request(request_id, text, ids, params, seed=seed, on_output=on_output, cache_salt=cache_salt,
                          mm=mm, lora_request=lora_request)
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

    def prepare_lora(self, lora_request: LoRARequest | None) -> None:
        """Loads and checks a request's adapter before anything of the request is added (InvalidRequestError if
        this engine has no adapters or it cannot be served)."""
        if lora_request is None:
            return
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (start it with enable_lora)",
                                      "lora_request")
        self.loras.prepare(lora_request)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self._emit(request)

    def reset_prefix_cache(self) -> bool:
        """Forgets the prefix cache's pages; False (and nothing forgotten) while requests run."""
        return not self.requests and self.block_manager.reset_prefix_cache()

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
        and the token's KV slot lies past anything the prefix cache registered. A drafted step has its successor
        dispatched on a guess instead (`_guess_ahead`), dropped unless the guess holds."""
        timed = self.drafter is not None and self.drafter.budget is not None
        begun = dispatched = None  # a step dispatched with none in flight: the draft budget times it
        if self._ahead is not None:
            pending, self._ahead = self._ahead, None
        else:
            begun = time.perf_counter() if timed else None
            if self.drafter is not None:
                self.drafter.propose(self.scheduler.running)
            step = self.scheduler.schedule()
            if not step:
                return []
            if self.drafter is not None:
                self.drafter.fill(step)
            dispatched = time.perf_counter() if timed else None
            pending = self.runner.dispatch(step)
        if self._may_look_ahead(pending.step) and (nxt := self.scheduler.lookahead(pending.step)) is not None:
            self._ahead = self.runner.dispatch(nxt, after=pending)
        else:
            self._guess_ahead(pending.step)
        result = self.runner.collect(pending)
        collected = time.perf_counter()
        outputs = self._update(pending.step, result)
        if self._guessed is not None:
            self._check_guess()
        if dispatched is None:
            return outputs
        host = dispatched - begun + time.perf_counter() - collected
        self.drafter.step_took(pending.bucket, collected - dispatched, host, any(pending.step.drafts))
        return outputs

    def _may_look_ahead(self, step) -> bool:
        """Whether the decode step after `step` can be built without `step`'s tokens: every sequence decodes one
        token, and nothing it samples with depends on the tokens (penalties read them, a grammar's mask follows
        them, min_tokens' bans end with a count), and no sequence's output is quoting text the drafter could draft
        from once the tokens are known. (A vision-language model's decode steps hold no image tokens, and their
        M-RoPE positions are known ahead.)"""
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
        # last: the drafter's lookups only for a step that could run ahead (never a drafted one)
        return going_on and not (self.drafter is not None and self.drafter.worth_waiting(step.seqs))

    def _guess_ahead(self, step) -> None:
        """Dispatches the drafted step that follows `step` (drafted, in flight) on the guess that it keeps every
        draft and samples the token the method expects (`Drafter.guess`): its ids are host-known, so it runs
        before `step` is read back, and the host's work between the two (reading back, verifying, proposing,
        building the next inputs) overlaps the device's. It is exactly the step the engine would run after
        `step` if the guess holds (`_check_guess`); otherwise its results are dropped, having cost its device
        time, and its KV writes lie past every sequence's progress."""
        if self.drafter is None or not self.config.async_scheduling or self._leader is not None or \
                len(step.seqs) != len(self.scheduler.running):  # none left out: a chain of guesses would starve it
            return
        guessed = self.drafter.guess(step)
        if guessed is None or any(stops_by_id(seq, gain, self.eos_token_ids)  # a guess past a stop is wasted
                                  for seq, (gain, _) in zip(step.seqs, guessed, strict=True)):
            return
        try:
            self.runner.bucket_for(sum(1 + len(d) for _, d in guessed), len(step.seqs))
        except ValueError:
            return
        nxt = self.scheduler.lookahead_guessed(step, guessed)
        if nxt is None:
            return
        self._ahead = self.runner.dispatch(nxt, assumed=[gain for gain, _ in guessed])
        self._guessed = [(seq, seq.num_tokens + len(gain), gain[-1])
                         for seq, (gain, _) in zip(step.seqs, guessed, strict=True)]

    def _check_guess(self) -> None:
        """After the guessed step's predecessor was read back: each sequence has the tokens guessed (every draft
        kept, the guessed token sampled), or the guessed step is dropped."""
        guessed, self._guessed = self._guessed, None
        held = all(not seq.finished and seq.num_tokens == n and seq.token_ids[-1] == last for seq, n, last in guessed)
        self.drafter.stats.observe_guess(held)
        if held:
            return
        self.scheduler.drop_guessed(self._ahead.step)
        self._ahead = None

    def _update(self, step, result: StepResult) -> list[RequestOutput]:
        pooled: list[Request] = []
        if result.prompt_logprobs is not None:
            prompt_logprobs.fill(*result.prompt_logprobs, self._token_text)
        if result.rejected is not None:
            self.drafter.observe(step, result.rejected)
        starts = self.scheduler.update_from_output(step, result.rejected)
        for i, (seq, start) in enumerate(zip(step.seqs, starts, strict=True)):
            if start is not None and seq.pooled is not None:
                seq.pooled.add_chunk(start, *result.pooled[0][i], result.pooled[1][i])
                if seq.num_computed_tokens == seq.num_tokens:  # pooled: its pages are freed now
                    self.scheduler.finish(seq, "stop")
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
        """Appends the row's tokens in order; one that stops the sequence drops those after it."""
        for j, token in enumerate(result.tokens[i]):
            seq.token_ids.append(token)
            self.generation_tokens_total += 1
            if seq.logprobs is not None:  # computed only when asked for (as in vLLM)
                k = seq.params.logprobs
                logprob = float(result.logprobs[i, j])
                seq.cumulative_logprob += logprob
                entry = {token: Logprob(logprob, int(result.ranks[i, j]), self._token_text(token))}
                for rank, (tid, lp) in enumerate(zip(result.top_ids[i, j, :k], result.top_logprobs[i, j, :k],
                                                     strict=True), 1):
                    entry.setdefault(int(tid), Logprob(float(lp), rank, self._token_text(int(tid))))
                seq.logprobs.append(entry)
            stop_str = seq.detokenizer.add_token(token)
            if (stop := check_stop(seq, token, stop_str, self.eos_token_ids, self.max_model_len)) is not None:
                self.scheduler.finish(seq, *stop)
                return

    def _fail_request(self, request: Request, error: Exception) -> None:
        logger.exception("request %s failed; the other requests go on", request.request_id, exc_info=error)
        request.error = f"{type(error).__name__}: {error}"
        self.num_failed_requests += 1
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "error")

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else ""

    def _emit(self, request: Request) -> RequestOutput | PoolingRequestOutput | None:
        """Builds the request's output and hands it to its callback; None when there is none (a FINAL_ONLY request
        still running). If either raises, the request ends (its pages freed) and the step goes on for everyone
        else; None is returned for it."""
        try:
            out = pooling_output(request) if isinstance(request.params, PoolingParams) else \
                generation_output(request)
            if out is None:
                return None
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
        } | (self.drafter.stats.counters() if self.drafter is not None else {}) | self._lora_stats()

    def _lora_stats(self) -> dict:
        """Requests per adapter name, running (a sequence in the batch) and waiting; the device's adapter slots
        (vLLM's lora_requests_info)."""
        if self.loras is None:
            return {}
        running: dict[str, set[str]] = {}
        waiting: dict[str, set[str]] = {}
        for queue, into in ((self.scheduler.running, running), (self.scheduler.waiting, waiting)):
            for seq in queue:
                lora = seq.request.lora_request
                if lora is not None:
                    into.setdefault(lora.lora_name, set()).add(seq.request.request_id)
        return {"lora_requests_running": {k: len(v) for k, v in running.items()},
                "lora_requests_waiting": {k: len(v) for k, v in waiting.items()},
                "lora_max_loras": self.config.max_loras}


__all__ = ["InvalidRequestError", "LLMEngine", "PromptTooLongError", "SequenceStatus"]
