"""POST /v1/completions and POST /v1/chat/completions, streaming (SSE) and not."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator

from flask import Blueprint, Response, current_app, g, jsonify, request, stream_with_context

from jaxllm.engine.frontend import Frontend
from jaxllm.engine.structured_output import schema_error
from jaxllm.errors import InvalidRequestError, PromptTooLongError
from jaxllm.lora.request import LoRARequest
from jaxllm.multimodal.chat import chat_images, has_images
from jaxllm.multimodal.image_input import ImagePolicy
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.reasoning import reasoning_parser
from jaxllm.sampling_params import SamplingParams
from jaxllm.tokenizer.chat_template import ChatTemplateError
from jaxllm.tools.parsers import parser_for_template, tool_parser
from server.bridge import offload
from server.disconnect import client_gone
from server.errors import ERROR_TYPES, APIError
from server.generation import ClientGone, Generation, Held
from server.parsing import invalid, parse, served_lora
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.state import ServerState
from server.tool_calls import ChoiceStream, tool_mode
from server.tool_calls import message as tool_message

bp = Blueprint("openai", __name__)
IMAGE_COST_CHARS = 1 << 20  # decoding an image costs like tokenizing this much text: always off the hub thread
access_log = logging.getLogger("jaxllm.access")


def state() -> ServerState:
    return current_app.extensions["jaxllm"]


def sampling_params(req, max_tokens, logprobs) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs)
    except InvalidRequestError as e:
        raise invalid(e) from None


def start(prompts: list[str | list[int]], params: SamplingParams | PoolingParams, cache_salt: str | None,
          prompt_param: str = "prompt", images: list | None = None, lora_request: LoRARequest | None = None
          ) -> Generation:
    """Validates and tokenizes the prompts (or a pooling request's inputs) off the hub thread, then hands them to
    the engine. images: a single prompt's images (decoded), preprocessed there too; lora_request: the adapter they
    run with (`served_lora`)."""
    frontend = state().frontend
    try:
        prepared = [offload(len(p) if isinstance(p, str) else 0, frontend.prepare_prompt, p, params, cache_salt,
                            *((images,) if images else ())) for p in prompts]
    except PromptTooLongError as e:
        raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded") from None
    except InvalidRequestError as e:
        if e.param == "multi_modal_data":  # what the HTTP request called it
            e.param = prompt_param
        raise invalid(e) from None
    environ = request.environ
    return Generation(state(), prepared, params, cache_salt=cache_salt, client_gone=lambda: client_gone(environ),
                      lora_request=lora_request)


def chat_prompt_ids(frontend: Frontend, req: ChatCompletionRequest, policy: ImagePolicy) -> tuple[list[int], list]:
    """Renders the chat template and tokenizes it; refuses a rendering too long to fit before tokenizing it.
    Returns the token ids and the messages' images (loaded under `policy`, decoded). Runs on a worker thread: no
    Flask context here."""
    messages = [m.as_template_input() for m in req.messages]
    images = []
    if has_images(messages):
        if frontend.mm_spec is None:
            raise InvalidRequestError("this model does not take images", "messages")
        messages, images = chat_images(messages, policy)
    tools = {"tools": req.tool_definitions()} if req.uses_tools() else {}
    text = frontend.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                **(req.chat_template_kwargs or {}), **tools)
    frontend.check_text_fits(text)
    return frontend.tokenizer.encode(text, add_special_tokens=False), images


def sse(events: Iterator[dict], gen: Generation, on_end: Callable[[], None]) -> Response:
    def body():
        try:
            yield ": stream open\n\n"  # an SSE comment: headers go out now, before the first token
            for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        except ClientGone:
            return
        except APIError as e:
            error = {"message": e.message, "type": ERROR_TYPES.get(e.status, "server_error"), "param": e.param,
                     "code": e.code}
            yield f"data: {json.dumps({'error': error})}\n\n"
        finally:  # also on client disconnect (GeneratorExit): free the engine's pages
            gen.finish()
            on_end()

    resp = Response(stream_with_context(body()), mimetype="text/event-stream")
    resp.headers["Cache-Control"] = "no-cache"
    resp.headers["X-Accel-Buffering"] = "no"
    return resp


def log_request(gen: Generation, status: int = 200) -> None:
    u = gen.usage
    access_log.info('%s "%s %s" %d request_id=%s prompt_tokens=%d completion_tokens=%d latency=%.3fs',
                    request.remote_addr, request.method, request.path, status, g.request_id, u["prompt_tokens"],
                    u["completion_tokens"], time.monotonic() - gen.start)


# -- completions
def _legacy_logprobs(pairs, n: int, tok, offset0: int) -> dict:
    """OpenAI's legacy completions logprobs of (token id, {token id: Logprob} or None) pairs: each token's text,
    logprob and top `n` alternatives (None for an entry with nothing before it to score against: an echoed prompt's
    first token), and text offsets from `offset0`."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset0
    for token_id, entry in pairs:
        if entry is None:
            text, lp, top = tok.decode([token_id], skip_special_tokens=False) if tok else "", None, None
        else:
            text, lp = entry[token_id].decoded_token, entry[token_id].logprob
            top = {e.decoded_token: e.logprob for e in sorted(entry.values(), key=lambda e: -e.logprob)[:n]}
        tokens.append(text)
        token_lps.append(lp)
        tops.append(top)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _completion_logprobs(c: CompletionOutput, n: int, tok, offset0: int) -> dict:
    return _legacy_logprobs(zip(c.token_ids, c.logprobs, strict=False), n, tok, offset0)


def _echoed_logprobs(out: RequestOutput, n: int, tok) -> dict:
    """The prompt's part of an echoed completion's logprobs (the first token's: None), offsets from 0."""
    return _legacy_logprobs(zip(out.prompt_token_ids, out.prompt_logprobs, strict=True), n, tok, 0)


def _joined(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def prompt_logprobs_json(out: RequestOutput) -> list | None:
    """vLLM's `prompt_logprobs` field: None, then per prompt token {token id: {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in out.prompt_logprobs]


@bp.post("/v1/completions")
def completions():
    req = parse(CompletionRequest)
    params = sampling_params(req, req.max_tokens, req.logprobs)
    lora = served_lora(req)
    gen = start(req.prompts(), params, req.cache_salt, lora_request=lora)
    created, model, cid = int(time.time()), lora.lora_name if lora else state().model_name, f"cmpl-{g.request_id}"
    tok = state().frontend.tokenizer

    def prompt_text(out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return tok.decode(out.prompt_token_ids, skip_special_tokens=False) if tok else ""

    def choice_index(i: int, c: CompletionOutput) -> int:
        return i * req.n + c.index

    if not req.stream:
        outs = gen.wait()
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                text = (prompt_text(out) if req.echo else "") + c.text
                lp = None
                if req.logprobs is not None and req.echo:
                    echoed = _echoed_logprobs(out, req.logprobs, tok)
                    offset = echoed["text_offset"][-1] + len(echoed["tokens"][-1])
                    lp = _joined(echoed, _completion_logprobs(c, req.logprobs, tok, offset))
                elif req.logprobs is not None:
                    lp = _completion_logprobs(c, req.logprobs, tok, 0)
                choice = {"index": choice_index(i, c), "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    choice |= {"prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out)
                choices.append(choice)
        log_request(gen)
        return jsonify({"id": cid, "object": "text_completion", "created": created, "model": model,
                        "choices": sorted(choices, key=lambda c: c["index"]), "usage": gen.usage})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def events():
        sent_chars: dict[tuple[str, int], int] = {}  # generated text sent so far (logprobs' text offsets)
        held: dict[tuple[str, int], Held] = {}
        echo_end: dict[tuple[str, int], int] = {}
        finished: set[tuple[str, int]] = set()
        for out in gen.updates():  # deltas: what is new since the last output
            i = gen.ids.index(out.request_id)
            for c in out.outputs:
                key = (out.request_id, c.index)
                if key in finished:
                    continue
                first = key not in sent_chars
                c = held.setdefault(key, Held()).take(c)
                delta = c.text
                if first and req.echo:
                    delta = prompt_text(out) + delta
                if not delta and not c.finished() and not first:
                    held[key].keep(c)  # tokens with no text yet: their logprobs go with the next chunk
                    continue
                lp = None
                if req.logprobs is not None:
                    echoed = _echoed_logprobs(out, req.logprobs, tok) if first and req.echo else None
                    if echoed is not None:  # offsets of the generated text count from the end of the echoed prompt
                        echo_end[key] = echoed["text_offset"][-1] + len(echoed["tokens"][-1])
                    lp = _completion_logprobs(c, req.logprobs, tok, echo_end.get(key, 0) + sent_chars.get(key, 0))
                    lp = _joined(echoed, lp) if echoed is not None else lp
                sent_chars[key] = sent_chars.get(key, 0) + len(c.text)
                if c.finished():
                    finished.add(key)
                choice = {"index": choice_index(i, c), "text": delta, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    choice |= {"prompt_token_ids": out.prompt_token_ids} if first else {}
                    choice["token_ids"] = c.token_ids
                yield {"id": cid, "object": "text_completion", "created": created, "model": model,
                       "choices": [choice]}
        if include_usage:
            yield {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
                   "usage": gen.usage}

    return sse(events(), gen, lambda: log_request(gen))


# -- chat
def _chat_logprobs(c: CompletionOutput, top_n: int) -> dict:
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs, strict=False):
        chosen = entry[token_id]
        ranked = sorted(entry.values(), key=lambda lp: -lp.logprob)[:top_n]
        content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                        "bytes": list(chosen.decoded_token.encode()),
                        "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                          "bytes": list(lp.decoded_token.encode())} for lp in ranked]})
    return {"content": content}


@bp.post("/v1/chat/completions")
def chat_completions():
    req = parse(ChatCompletionRequest)
    st = state()
    tok = st.frontend.tokenizer
    top_n = req.top_logprobs or 0
    if tok is None:
        raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids", param="messages")
    for t in req.tools or ():
        if t.function.parameters is not None and (error := schema_error(t.function.parameters)):
            raise APIError(400, f"tools: the parameters of {t.function.name!r} are not a valid JSON schema: {error}",
                           param="tools")
    params = sampling_params(req, req.max_new_tokens(), top_n if req.logprobs else None)
    mode = tool_mode(req)
    thinking = reasoning_parser(st.settings.reasoning_parser) if st.settings.reasoning_parser else None
    parser = None
    if mode == "auto":
        parser = tool_parser(st.settings.tool_call_parser or parser_for_template(
            tok.chat_template.source if tok.chat_template else None))
    try:
        ids, images = offload(req.text_chars() + IMAGE_COST_CHARS * sum(m.has_images() for m in req.messages),
                              chat_prompt_ids, st.frontend, req, st.settings.image_policy)
    except PromptTooLongError as e:
        raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
    except InvalidRequestError as e:
        raise APIError(400, str(e), param="messages") from None
    except (ChatTemplateError, ValueError) as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    lora = served_lora(req)
    gen = start([ids], params, req.cache_salt, prompt_param="messages", images=images, lora_request=lora)
    created, model, cid = int(time.time()), lora.lora_name if lora else st.model_name, f"chatcmpl-{g.request_id}"

    if not req.stream:
        (out,) = gen.wait()
        choices = []
        for c in out.outputs:
            split = thinking.split(c.text, True) if thinking else None
            text = split.content if split else c.text
            msg, finish = ({"role": "assistant", "content": text}, c.finish_reason) if mode is None else \
                tool_message(mode, req, parser, text, c.finish_reason)
            if split:
                msg["reasoning_content"] = split.reasoning or None
            choices.append({"index": c.index, "message": msg,
                            "logprobs": _chat_logprobs(c, top_n) if req.logprobs else None,
                            "finish_reason": finish, "stop_reason": c.stop_reason,
                            **({"token_ids": c.token_ids} if req.return_token_ids else {})})
        log_request(gen)
        body = {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": gen.usage}
        if req.return_token_ids:
            body["prompt_token_ids"] = out.prompt_token_ids
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out)
        return jsonify(body)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices, usage=None):
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices}
        if include_usage:
            body["usage"] = usage
        return body

    def with_ids(choice: dict, c: CompletionOutput) -> dict:
        """A choice's chunk that carries its tokens (the one that carries their logprobs)."""
        return {**choice, "token_ids": c.token_ids} if req.return_token_ids else choice

    def events():
        # The plain case streams each delta as it comes; a reasoning or tool-call parser reads the whole text so far
        # (kept here) and what it parsed is diffed against what was sent.
        whole = thinking is not None or mode is not None
        texts: dict[int, str] = {}
        sent_text: dict[int, int] = {}
        sent_reasoning: dict[int, int] = {}
        held: dict[int, Held] = {}
        finished: set[int] = set()
        tool_streams = {c: ChoiceStream(mode, req, parser) for c in range(req.n)} if mode else {}
        for c in range(req.n):
            first = chunk([{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])
            yield {**first, "prompt_token_ids": gen.prompt_ids[0]} if req.return_token_ids and c == 0 else first
        for out in gen.updates():  # deltas: what is new since the last output
            for c in out.outputs:
                if c.index in finished:
                    continue
                c = held.setdefault(c.index, Held()).take(c)
                if whole:
                    texts[c.index] = text = texts.get(c.index, "") + c.text
                    split = thinking.split(text, c.finished()) if thinking else None
                    text = split.content if split else text
                    reasoning = split.reasoning[sent_reasoning.get(c.index, 0):] if split else ""
                    delta = text[sent_text.get(c.index, 0):]
                    sent_text[c.index] = len(text)
                    sent_reasoning[c.index] = len(split.reasoning) if split else 0
                else:
                    delta, reasoning = c.text, ""
                if not delta and not reasoning and not c.finished():
                    held[c.index].keep(c, text=not whole)  # their logprobs go with the next chunk
                    continue
                lp = _chat_logprobs(c, top_n) if req.logprobs else None
                if c.finished():
                    finished.add(c.index)
                if reasoning:
                    alone = mode is None and not (delta or c.finished())  # no content chunk follows
                    choice = {"index": c.index, "delta": {"reasoning_content": reasoning},
                              "logprobs": lp if alone else None, "finish_reason": None}
                    yield chunk([with_ids(choice, c) if alone else choice])
                if mode is None:
                    if delta or c.finished() or not reasoning:
                        yield chunk([with_ids({"index": c.index, "delta": {"content": delta} if delta else {},
                                               "logprobs": lp, "finish_reason": c.finish_reason,
                                               "stop_reason": c.stop_reason}, c)])
                    continue
                deltas, called = tool_streams[c.index].deltas(text, c.finished(), c.finish_reason == "stop")
                finish = c.finish_reason
                if c.finished() and called and finish == "stop":
                    finish = "tool_calls"
                for i, d in enumerate(deltas or [{}]):
                    last = i == max(len(deltas), 1) - 1
                    choice = {"index": c.index, "delta": d, "logprobs": lp if last else None,
                              "finish_reason": finish if last else None, "stop_reason": c.stop_reason if last else None}
                    yield chunk([with_ids(choice, c) if last else choice])
        if include_usage:
            yield chunk([], gen.usage)

    return sse(events(), gen, lambda: log_request(gen))
