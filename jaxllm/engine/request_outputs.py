"""A request's output as the API returns it, built from its sequences' state in the form its params ask for
(`RequestOutputKind`): everything so far, what is new since the last output, or one output at the end. A DELTA
output costs what it carries, so a stream of them costs O(tokens) over its whole length."""

from __future__ import annotations

from jaxllm.engine.sequence import Request, Sequence
from jaxllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxllm.sampling_params import RequestOutputKind


def generation_output(request: Request) -> RequestOutput | None:
    """The request's next output, or None when its kind has nothing to hand out now (FINAL_ONLY, unfinished)."""
    kind = request.params.output_kind
    if kind == RequestOutputKind.FINAL_ONLY and not request.finished:
        return None
    delta = kind == RequestOutputKind.DELTA
    first = request.num_outputs == 0
    request.num_outputs += 1
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                         [_choice(s, delta) for s in request.seqs], request.finished,
                         num_cached_tokens=request.seqs[0].num_cached_tokens, error=request.error,
                         prompt_logprobs=request.prompt_logprobs if first or not delta else None)


def _choice(s: Sequence, delta: bool) -> CompletionOutput:
    logprobs = s.logprobs
    if delta:
        e = s.emitted
        text = s.detokenizer.visible_text(s.finished, e.chars)
        token_ids = s.token_ids[s.num_prompt_tokens + e.tokens:]
        logprobs = None if logprobs is None else logprobs[e.logprobs:]
        e.chars, e.tokens = e.chars + len(text), s.num_output_tokens
        e.logprobs = 0 if s.logprobs is None else len(s.logprobs)
    else:
        text, token_ids = s.detokenizer.visible_text(s.finished), s.output_token_ids
    return CompletionOutput(index=s.index, text=text, token_ids=token_ids,
                            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                            logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)


def pooling_output(request: Request) -> PoolingRequestOutput:
    seq = request.seqs[0]
    done = seq.finish_reason == "stop"
    data = PoolingOutput(seq.pooled.result(seq.num_tokens, request.params)) if done else None
    return PoolingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids, data,
                                request.finished, error=request.error, num_cached_tokens=seq.num_cached_tokens)
