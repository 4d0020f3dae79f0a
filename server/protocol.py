"""Request bodies of the OpenAI API (fields in OpenAI's order, then vLLM's extras), validated with pydantic,
and their translation into `SamplingParams`.

pydantic checks the JSON shape (strict types: no "3" for 3, no true for 1; no NaN or infinity; every number
bounded); the ranges that every entry point shares are checked by `SamplingParams` itself, and the limits
that need the model (vocabulary, context left, maximum n) by the engine. These models also generate the
server's OpenAPI document (server/openapi.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import (
    MAX_INT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from jaxllm.tools.choice import named_schema, required_schema

Count = Annotated[int, Field(ge=1, le=MAX_INT)]
Name = Annotated[str, Field(max_length=256)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "tokenize", "bos_token", "eos_token"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class JsonSchemaFormat(_Model):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    """OpenAI's `response_format`: free text, any JSON object, or JSON that validates against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs 'json_schema'")
        return self


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a list of choices, a Lark or GBNF
    grammar, or any JSON object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Model):
    """Fields shared by both endpoints, in OpenAI's order, then vLLM's extras."""

    model: Name | None = None
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    n: Count = 1
    presence_penalty: Penalty = 0.0
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    user: Annotated[str, Field(max_length=1024)] | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] = 1.0
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        default=None, description="Requests with different salts never share prefix-cache pages (one per tenant).")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        default=None, description="vLLM's: each prompt token's logprob and the k likeliest at its position "
                                  "(returned as prompt_logprobs; not with stream)")
    return_token_ids: bool = Field(
        default=False, description="vLLM's: each choice's generated token ids (token_ids; streamed: each chunk's) "
                                   "and the prompt's (prompt_token_ids; streamed: in the first chunk)")

    @model_validator(mode="after")
    def _check(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not supported when stream is true")
        return self

    def scored_prompt(self) -> int | None:
        """How many alternatives per prompt token to score (None: the prompt is not scored)."""
        return self.prompt_logprobs

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint of `structured_outputs` or `response_format` (raises SamplingParamsError)."""
        fmt = self.response_format if self.response_format and self.response_format.type != "text" else None
        if self.structured_outputs is not None:
            if fmt is not None:
                raise SamplingParamsError("set structured_outputs or response_format, not both",
                                          "structured_outputs")
            so = self.structured_outputs
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=bool(so.json_object))
        if fmt is None:
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = fmt.json_schema.schema_
        return StructuredOutputsParams(json=schema if schema is not None else {"type": "object"})

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises SamplingParamsError (a 400 naming the parameter)."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stops(),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.constraint(), prompt_logprobs=self.scored_prompt())


class CompletionRequest(_Sampling):
    prompt: (str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[list[TokenId]], Field(min_length=1)])
    best_of: Count | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: Count | None = 16
    suffix: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_prompt_shape(cls, data):
        """One clear message for a malformed prompt, rather than one per member of its union."""
        p = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(p, list) and p:
            def token_ids(x):
                return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in x)

            if not (all(isinstance(x, str) for x in p) or token_ids(p) or all(token_ids(x) for x in p)):
                raise ValueError("prompt: must be a string, a list of strings, a list of token ids (non-negative "
                                 "integers) or a list of such lists")
        return data

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        return self

    def scored_prompt(self) -> int | None:
        """echo with logprobs scores the prompt too (OpenAI's legacy completions; what evaluation harnesses ask)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ImageURL(_Model):
    url: Annotated[str, Field(min_length=1)]  # a data: URL (base64), or http(s) when the server allows it
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Model):
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.type not in ("text", "image_url"):
            raise ValueError(f"content part type {self.type!r} is not supported")
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs 'text'")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url content part needs 'image_url'")
        return self


class FunctionCall(_Model):
    name: Name
    arguments: Annotated[str, Field(max_length=1_000_000)]


class ToolCallIn(_Model):
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Model):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Annotated[str, Field(max_length=100_000)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: Name


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=128)] | None = None  # assistant messages
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None  # tool messages

    def text(self) -> str:
        content = self.content
        return "".join(part.text or "" for part in content) if isinstance(content, list) else content or ""

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(part.type == "image_url" for part in self.content)

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined, unless it holds images (then its parts, for
        `jaxllm.multimodal.chat.chat_images` to load)."""
        content = self.content
        if self.has_images():
            content = [part.model_dump(exclude_none=True) for part in content]
        elif isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            # templates read arguments as an object (Llama 3.1's `| tojson`) or accept either (Qwen's)
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def message_chars(messages: list[ChatMessage]) -> int:
    """Characters of message text (what templating and tokenizing cost grows with)."""
    return sum(len(m.text()) for m in messages)


def _check_messages(messages: list[ChatMessage]) -> None:
    if not any(m.text().strip() or m.tool_calls or m.has_images() for m in messages):
        raise ValueError("messages: every message is empty or whitespace")


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    max_completion_tokens: Count | None = None
    max_tokens: Count | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        _check_messages(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: names the function {choice.function.name!r}, which is not among tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        if self.forced_tool_call() and (self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("tool_choice: a required or named tool call cannot be combined with response_format "
                             "or structured_outputs")
        reserved = RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or ())
        if reserved:
            raise ValueError(f"chat_template_kwargs: {sorted(reserved)} are set by the server")
        return self

    def text_chars(self) -> int:
        return message_chars(self.messages)

    def uses_tools(self) -> bool:
        """Whether the tools are rendered and the answer read for calls (not with tool_choice "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tool_call(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def tool_definitions(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def constraint(self) -> StructuredOutputsParams | None:
        if not self.forced_tool_call():
            return super().constraint()
        tools = {t.function.name: t.function.parameters for t in self.tools}
        if isinstance(self.tool_choice, NamedToolChoice):
            return StructuredOutputsParams(json=named_schema(tools[self.tool_choice.function.name]))
        return StructuredOutputsParams(json=required_schema(list(tools.items()), self.parallel_tool_calls))

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Model):
    model: Name | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt: must not be empty")
        return self


class DetokenizeRequest(_Model):
    model: Name | None = None
    tokens: list[TokenId]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request


class EmbeddingRequest(_Model):
    """POST /v1/embeddings (and /pooling): OpenAI's fields, then vLLM's extras."""

    input: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    model: Name | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    truncate_prompt_tokens: Count | None = None
    normalize: bool | None = None
    cache_salt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_input_shape(cls, data):
        """One clear message for a malformed input, rather than one per member of its union."""
        x = data.get("input") if isinstance(data, dict) else None
        if isinstance(x, list):
            if not x:
                raise ValueError("input: must not be empty")
            if len(x) > MAX_EMBEDDING_INPUTS and not all(isinstance(t, int) for t in x):
                raise ValueError(f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(x)}")

            def token_ids(v):
                return isinstance(v, list) and bool(v) and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)

            if not (all(isinstance(v, str) for v in x) or token_ids(x) or all(token_ids(v) for v in x)):
                raise ValueError("input: must be a string, a list of strings, a list of token ids (non-negative "
                                 "integers) or a list of such lists, not a mix")
        return data

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if isinstance(x[0], int):
            return [list(x)]
        return list(x)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(normalize=self.normalize, dimensions=self.dimensions,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


class ScoreRequest(_Model):
    """POST /score (vLLM's): text_1 against each text_2 (1:N), or element-wise (N:N)."""

    model: Name | None = None
    text_1: str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    text_2: str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    truncate_prompt_tokens: Count | None = None


class RerankDocument(_Model):
    text: str


class RerankRequest(_Model):
    """POST /rerank and /v1/rerank (Jina's and Cohere's shape)."""

    model: Name | None = None
    query: str
    documents: Annotated[list[str | RerankDocument], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    top_n: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    return_documents: bool = True
    truncate_prompt_tokens: Count | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class LoadLoRAAdapterRequest(_Model):
    """POST /v1/load_lora_adapter (vLLM's)."""

    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_inplace: bool = False  # replace an adapter of that name (requests running keep the old one)


class UnloadLoRAAdapterRequest(_Model):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: Name
    lora_int_id: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None  # if given, must be the adapter's
