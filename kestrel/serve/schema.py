"""The OpenAPI document of the server (`GET /openapi.json`): request and response bodies as pydantic models.

The models describe the wire format for clients and fuzzers; requests are still validated field by field in
`protocol.py`, which words every refusal. The request models take this server's limits (n, stop strings), so a body
built from the document is one the server accepts or refuses only for reasons the document cannot express
(context length, token budget, text that encodes to no tokens).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from kestrel.serve.protocol import CHAT_ROLES, MAX_LOGPROBS, SEED_MAX, SEED_MIN, Limits

TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")     # unknown fields are ignored, as OpenAI does


# ---- responses ---------------------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: None = None
    token_ids: list[int] | None = Field(None, description="with `return_token_ids`")
    prompt_token_ids: list[int] | None = Field(None, description="with `return_token_ids`")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object as a string (valid against the tool's parameters when the "
                                        "call was forced by tool_choice required or a named function)")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the turn is only tool calls")
    reasoning_content: str | None = Field(None, description="the thinking, apart from content (a reasoning parser)")
    tool_calls: list[ToolCall] | None = Field(None, description="the calls the model made (a tool-call parser)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    token_ids: list[int] | None = Field(None, description="with `return_token_ids`")
    prompt_token_ids: list[int] | None = Field(None, description="with `return_token_ids`")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str = Field(description="the served model name (--served-model-name)")
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# ---- requests ----------------------------------------------------------------------------------------------

def request_models(limits: Limits) -> tuple[type[BaseModel], type[BaseModel]]:
    """(completion request, chat request) for a server with these limits."""
    StopText = Annotated[str, Field(min_length=1, max_length=limits.max_stop_chars)]
    Stop = StopText | Annotated[list[StopText], Field(max_length=limits.max_stop)]
    Prompts = Annotated[list[Text], Field(min_length=1, max_length=limits.max_choices)]
    Ids = Annotated[list[TokenId], Field(min_length=1)]
    IdLists = Annotated[list[Ids], Field(min_length=1, max_length=limits.max_choices)]

    class StreamOptions(_Open):
        include_usage: bool | None = None

    class Sampling(_Open):
        model: str | None = Field(None, description="must be the served model name when given")
        max_tokens: int | None = Field(None, ge=1, description="default: completions 16, chat the rest of the "
                                                               "context, within --max-request-tokens")
        temperature: float | None = Field(None, ge=0)
        top_p: float | None = Field(None, gt=0, le=1)
        top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
        min_p: float | None = Field(None, ge=0, le=1)
        seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX - limits.max_choices)
        stop: Stop | None = None
        stop_token_ids: list[TokenId] | None = None
        n: int | None = Field(None, ge=1, le=limits.max_choices)
        stream: bool | None = None
        stream_options: StreamOptions | None = Field(None, description="only with `stream`")
        ignore_eos: bool | None = None
        user: str | None = None
        return_token_ids: bool | None = None
        best_of: int | None = Field(None, ge=1, description="only best_of = n")
        presence_penalty: float | None = Field(None, ge=0, le=0, description="not supported: 0 only")
        frequency_penalty: float | None = Field(None, ge=0, le=0, description="not supported: 0 only")
        repetition_penalty: float | None = Field(None, ge=1, le=1, description="not supported: 1 only")
        logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not supported: empty only")

    class CompletionRequest(Sampling):
        prompt: Text | Prompts | Ids | IdLists = Field(
            description="text, texts, token ids, or lists of token ids (not empty); prompts x n <= "
                        f"{limits.max_choices}")
        echo: bool | None = None
        logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="not together with `echo`")
        suffix: str | None = Field(None, max_length=0, description="not supported")

    class TextPart(_Open):
        type: Literal["text"]
        text: str

    class Message(_Open):
        role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
        content: str | list[TextPart] | None = None
        name: str | None = None
        tool_calls: list[ToolCall] | None = Field(None, description="assistant messages: the calls made")
        tool_call_id: str | None = Field(None, description="required on role tool: the call it answers")
        reasoning_content: str | None = Field(None, description="assistant messages: the thinking")

    class Function(_Open):
        name: str = Field(pattern=r"^[A-Za-z0-9_\-.]{1,64}$")
        description: str | None = None
        parameters: dict[str, Any] | None = Field(None, description="a JSON schema of an object")
        strict: bool | None = None

    class Tool(_Open):
        type: Literal["function"]
        function: Function

    class NamedFunction(_Open):
        name: str

    class NamedToolChoice(_Open):
        type: Literal["function"]
        function: NamedFunction

    class JsonSchema(_Open):
        name: str
        schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema")
        strict: bool | None = None

    class TextFormat(_Open):
        type: Literal["text"]

    class JsonObjectFormat(_Open):
        type: Literal["json_object"]

    class JsonSchemaFormat(_Open):
        type: Literal["json_schema"]
        json_schema: JsonSchema

    class ChatCompletionRequest(Sampling):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
        logprobs: bool | None = None
        top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs `logprobs`")
        add_generation_prompt: bool | None = None
        chat_template_kwargs: dict[str, Any] | None = Field(
            None, description="more arguments for the chat template (not messages, add_generation_prompt, "
                              "bos_token, eos_token)")
        tools: list[Tool] | None = Field(None, description="functions the model may call (names unique)")
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
            None, description="required / a named function: the output is a call valid against the schema "
                              "(enforced by a grammar); a named function must be one of `tools`")
        parallel_tool_calls: bool | None = None
        response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = Field(
            None, description="json_object / json_schema: the content is JSON (valid against the schema); not "
                              "together with a forced tool call")
        reasoning_effort: Literal["none", "low", "medium", "high", "max"] | None = Field(
            None, description="passed to the chat encoding (K3: low, high, max, or none to not think)")
        functions: list[Any] | None = Field(None, max_length=0, description="not supported: use `tools`")

    return CompletionRequest, ChatCompletionRequest


# ---- routes ------------------------------------------------------------------------------------------------

_ERRORS = {code: {"model": Error, "description": why} for code, why in {
    400: "a bad field (named in `error.param`)", 401: "no or a wrong API key", 404: "unknown model",
    408: "the body arrived too slowly", 413: "the body is too large", 415: "the body is not JSON",
    503: "the server is shutting down"}.items()}
_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events (`data: {chunk}`), "
                                            "ending with `data: [DONE]`"}}}
_BODIES = {"completions": "CompletionRequest", "chat": "ChatCompletionRequest"}


def route(name: str) -> dict:
    """Keyword arguments for the route decorator of `name`: its summary, request body and responses."""
    if name == "models":
        return {"summary": "The served model", "responses": {200: {"model": ModelList}, 401: _ERRORS[401]}}
    if name == "model":
        return {"summary": "One model", "responses": {200: {"model": ModelCard}, 401: _ERRORS[401],
                                                      404: _ERRORS[404]}}
    if name == "metrics":
        return {"summary": "Prometheus metrics",
                "responses": {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                    "description": "Prometheus text format 0.0.4"}, 401: _ERRORS[401]}}
    model = Completion if name == "completions" else ChatCompletion
    body = {"$ref": f"#/components/schemas/{_BODIES[name]}"}
    return {"summary": "Text completions" if name == "completions" else "Chat completions",
            "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
            "responses": {200: {"model": model, "content": _STREAM, "description": "the answer, or its stream"},
                          **_ERRORS}}


def openapi(app, limits: Limits) -> dict:
    """The document for `app`'s routes, with the request bodies for these limits added to its components."""
    doc = get_openapi(title="Kestrel", version="1", description="OpenAI-compatible API", routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in request_models(limits):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    return doc
