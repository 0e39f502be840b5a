"""The OpenAI wire format: request parsing and validation, response and stream-chunk shapes.

Requests are read field by field (not through a schema library) so that every error names the field it is about,
in OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`. Unknown fields are ignored; known
OpenAI features this engine does not implement (penalties, logit bias, legacy `functions`) are refused with a 400
rather than silently ignored. Chat's tool and structured-output fields are read by `kestrel.serve.chat.request`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kestrel.serve.chat.request import FieldError, ToolRequest, parse_tool_request
from kestrel.tokenizer import TEMPLATE_OWN_ARGUMENTS

MAX_LOGPROBS = 20          # the engine returns at most 20 alternatives per token
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_JSON_DEPTH = 64        # nesting of a request body (tool schemas nest a few levels; nothing needs 64)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; each is a `kestrel serve` flag, and each refusal a 4xx naming it."""
    max_request_bytes: int = 16 * 2 ** 20   # --max-request-bytes: the body (413)
    max_choices: int = 128                  # --max-choices: prompts x n, one engine request each
    max_stop: int = 16                      # --max-stop: stop strings
    max_stop_chars: int = 256               # --max-stop-chars: characters of one stop string
    max_request_tokens: int = 65536         # --max-request-tokens: max_tokens summed over a request's choices


class APIError(Exception):
    """An error answered to the client: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "invalid_request_error",
                             404: "invalid_request_error", 405: "invalid_request_error",
                             413: "invalid_request_error", 500: "server_error",
                             503: "server_error"}.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(param: str, why: str) -> APIError:
    return APIError(400, f"`{param}` {why}", param=param)


def dumps(obj: Any) -> str:
    """JSON text of a response; a string that cannot be UTF-8 (a lone surrogate) is written as an escape."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


def _not_json(name: str):
    raise APIError(400, f"the request body is not valid JSON: `{name}` is not a JSON number; send a finite number")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, with no value nested deeper than MAX_JSON_DEPTH and no string that is
    not Unicode text (a lone surrogate, which `\\ud800` escapes can spell)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" ({e.msg} at line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise APIError(400, f"the request body is not valid JSON{where}: send a JSON object") from None
    except RecursionError:
        raise APIError(400, f"the request body nests arrays or objects too deeply; at most {MAX_JSON_DEPTH} "
                            "levels are accepted") from None
    except ValueError as e:        # an integer past Python's digit limit for int/str conversions
        raise APIError(400, f"the request body has a number that cannot be read ({e}); send smaller numbers") \
            from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {_json_type(body)}")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    """Walk the body (without recursion): refuse nesting past MAX_JSON_DEPTH and strings with lone surrogates,
    naming where they are."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                raise bad(path, "contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
                                "not a character; send valid Unicode text")
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad(path, f"nests arrays or objects more than {MAX_JSON_DEPTH} levels deep; flatten it")
        if isinstance(value, dict):
            for k, v in value.items():
                where = f"{path}.{k}" if path else k
                if _has_surrogate(k):
                    where = f"{path}.<key>" if path else "<key>"
                    raise bad(where, "is an object key with a lone UTF-16 surrogate; send valid Unicode text")
                if isinstance(v, (str, dict, list)):
                    stack.append((v, where, depth + 1))
        else:
            for i, v in enumerate(value):
                if isinstance(v, (str, dict, list)):
                    stack.append((v, f"{path}[{i}]", depth + 1))


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def show(v: Any, limit: int = 60) -> str:
    """A value quoted in an error message: its JSON form, cut to `limit` characters."""
    text = dumps(v) if not isinstance(v, int) or abs(v) < 10 ** 30 else f"an integer of {len(str(abs(v)))} digits"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)     # isfinite() of a huge int overflows


class _Fields:
    """Typed access to a request body's fields; every failure is a 400 naming the field."""

    def __init__(self, body: dict):
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def int(self, name: str, default: int | None = None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if not _is_int(v):
            raise bad(name, f"must be an integer, got {_json_type(v)}")
        if lo is not None and v < lo or hi is not None and v > hi:
            raise bad(name, f"= {show(v)} is out of range: {_range(lo, hi)}")
        return v

    def number(self, name: str, default: float, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if not _is_num(v):
            kind = "too large to be a finite number" if isinstance(v, float) else f"{_json_type(v)}"
            raise bad(name, f"must be a finite number, got {kind}")
        if lo is not None and (v < lo or lo_open and v == lo) or hi is not None and v > hi:
            lo_s = f"> {lo}" if lo_open else f">= {lo}"
            raise bad(name, f"= {show(v)} is out of range: it must be {lo_s}"
                      + (f" and <= {hi}" if hi is not None else ""))
        try:
            return float(v)
        except OverflowError:       # an integer past the float range
            raise bad(name, f"= {show(v)} is too large to be a number") from None

    def bool(self, name: str, default: bool = False) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(name, f"must be a boolean, got {_json_type(v)}")
        return v

    def str(self, name: str, default: str | None = None) -> str | None:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad(name, f"must be a string, got {_json_type(v)}")
        return v


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"it must be between {lo} and {hi}"
    return f"it must be >= {lo}" if lo is not None else f"it must be <= {hi}"


@dataclass
class GenerationRequest:
    """What /v1/completions and /v1/chat/completions have in common."""
    model: str | None
    max_tokens: int | None            # None: completions 16, chat the rest of the context
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    user: str | None
    return_token_ids: bool
    num_logprobs: int | None          # alternatives per token; None = no logprobs
    max_tokens_param: str             # the field max_tokens came from (for error messages)


@dataclass
class CompletionRequest(GenerationRequest):
    prompts: list = field(default_factory=list)     # each a str or a list of token ids
    echo: bool = False


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = field(default_factory=list)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)
    tools: ToolRequest = field(default_factory=ToolRequest)    # tools, tool_choice, response_format, effort
    response_format: dict | None = None     # as the request gave it (K3's encoding writes it into the prompt)


def _common(f: _Fields, body: dict, limits: Limits) -> dict:
    mt_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = f.int(mt_param, lo=1)
    n = f.int("n", 1, lo=1)
    if n > limits.max_choices:
        raise bad("n", f"= {show(n)} is more choices than this server allows per request (max_choices = "
                       f"{limits.max_choices}, `kestrel serve --max-choices`); ask for fewer")
    seed = f.int("seed", lo=SEED_MIN, hi=SEED_MAX)
    if seed is not None and seed + n - 1 > SEED_MAX:
        raise bad("seed", f"= {seed} is too large for n = {n}: choice i uses seed + i, which must stay <= {SEED_MAX}")
    stream = f.bool("stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options", f"must be an object, got {_json_type(so)}")
        if not stream:
            raise bad("stream_options", "is only allowed when `stream` is true")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise bad("stream_options.include_usage", f"must be a boolean, got {_json_type(iu)}")
        include_usage = bool(iu)
    best_of = f.int("best_of", lo=1)
    if best_of is not None and best_of != n:
        raise bad("best_of", f"= {best_of} is not supported (only best_of = n); drop it")
    for name in ("presence_penalty", "frequency_penalty"):
        if f.number(name, 0.0, lo=-2.0, hi=2.0) != 0:
            raise bad(name, "is not supported by this server; send 0 or leave it out")
    if f.number("repetition_penalty", 1.0, lo=0.0, lo_open=True) != 1:
        raise bad("repetition_penalty", "is not supported by this server; send 1 or leave it out")
    lb = body.get("logit_bias")
    if lb is not None and (not isinstance(lb, dict) or lb):
        raise bad("logit_bias", "is not supported by this server; leave it out")
    return dict(
        model=f.str("model"),
        max_tokens=max_tokens,
        temperature=f.number("temperature", 1.0, lo=0.0),
        top_p=f.number("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=f.int("top_k", 0, lo=-1),
        min_p=f.number("min_p", 0.0, lo=0.0, hi=1.0),
        seed=seed,
        stop=_stop(body.get("stop"), limits),
        stop_token_ids=_token_list(body.get("stop_token_ids"), "stop_token_ids", allow_empty=True) or [],
        n=n,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=f.bool("ignore_eos"),
        user=f.str("user"),
        return_token_ids=f.bool("return_token_ids"),
        num_logprobs=None,
        max_tokens_param=mt_param,
    )


def _stop(v: Any, limits: Limits) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise bad("stop", f"must be a string or an array of strings, got {_json_type(v)}")
    if len(v) > limits.max_stop:
        raise bad("stop", f"has {len(v)} stop strings; this server allows at most max_stop = {limits.max_stop} "
                          "(`kestrel serve --max-stop`)")
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise bad("stop", f"[{i}] must be a string, got {_json_type(s)}")
        if not s:
            raise bad("stop", f"[{i}] is an empty string; stop strings must be non-empty")
        if len(s) > limits.max_stop_chars:
            raise bad("stop", f"[{i}] has {len(s)} characters; this server allows at most max_stop_chars = "
                              f"{limits.max_stop_chars} per stop string (`kestrel serve --max-stop-chars`)")
    return list(v)


def _token_list(v: Any, param: str, allow_empty: bool = False) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad(param, "must be an array of integer token ids")
    if not v and not allow_empty:
        raise bad(param, "is empty: give at least one token")
    neg = [t for t in v if t < 0]
    if neg:
        raise bad(param, f"contains the negative token id {neg[0]}")
    return list(v)


def parse_completion(body: dict, limits: Limits = Limits()) -> CompletionRequest:
    f = _Fields(body)
    common = _common(f, body, limits)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "is required")
    p = body["prompt"]
    if isinstance(p, str):
        prompts = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompts = [_token_list(p, "prompt")]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        prompts = [_token_list(x, f"prompt[{i}]") for i, x in enumerate(p)]
    elif isinstance(p, list) and not p:
        raise bad("prompt", "is an empty array: give a string, an array of strings, or token ids")
    else:
        raise bad("prompt", "must be a string, an array of strings, an array of token ids, or an array of "
                            "arrays of token ids")
    for i, x in enumerate(prompts):
        if x == "":
            raise bad("prompt" if len(prompts) == 1 else f"prompt[{i}]", "is empty: give at least one token")
    if len(prompts) * common["n"] > limits.max_choices:
        raise bad("prompt", f"has {len(prompts)} prompts x n = {common['n']} choices, more than this server allows "
                            f"per request (max_choices = {limits.max_choices}, `kestrel serve --max-choices`); "
                            "send fewer prompts per request")
    if f.str("suffix"):
        raise bad("suffix", "is not supported by this server; leave it out")
    echo = f.bool("echo")
    lp = f.int("logprobs", lo=0, hi=MAX_LOGPROBS)
    if echo and lp is not None:
        raise bad("echo", "together with `logprobs` needs the prompt tokens' log-probabilities, which this server "
                          "does not compute; drop one of them")
    common["num_logprobs"] = lp
    return CompletionRequest(**common, prompts=prompts, echo=echo)


def parse_chat(body: dict, limits: Limits = Limits()) -> ChatRequest:
    f = _Fields(body)
    common = _common(f, body, limits)
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "is required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty array of message objects")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    logprobs = f.bool("logprobs")
    top = f.int("top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top and not logprobs:
        raise bad("top_logprobs", "needs `logprobs` set to true")
    common["num_logprobs"] = (top or 0) if logprobs else None
    if body.get("functions"):
        raise bad("functions", "the legacy `functions` field is not supported; declare them in `tools`")
    try:
        tools = parse_tool_request(body)
    except FieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", f"must be an object, got {_json_type(kwargs)}")
    for key in kwargs:
        if key in TEMPLATE_OWN_ARGUMENTS:
            hint = "use the request's own `add_generation_prompt` field" if key == "add_generation_prompt" else \
                "the server sets it"
            raise bad(f"chat_template_kwargs.{key}", f"cannot be passed to the chat template: {hint}; drop it")
    return ChatRequest(**common, messages=messages, add_generation_prompt=f.bool("add_generation_prompt", True),
                       chat_template_kwargs=dict(kwargs), tools=tools,
                       response_format=body.get("response_format"))


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(where, f"must be an object with `role` and `content`, got {_json_type(m)}")
    role = m.get("role")
    if not isinstance(role, str):
        raise bad(f"{where}.role", "is required and must be a string")
    if role not in CHAT_ROLES:
        raise bad(f"{where}.role", f"= {show(role)} is not one of {', '.join(CHAT_ROLES)}")
    content = m.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            pw = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise bad(pw, f"must be a content-part object, got {_json_type(part)}")
            if part.get("type") != "text":
                raise bad(f"{pw}.type", f"= {show(part.get('type'))} is not supported; this model reads text parts "
                                        "only")
            if not isinstance(part.get("text"), str):
                raise bad(f"{pw}.text", "is required and must be a string")
            parts.append(part["text"])
        text = "\n".join(parts)
    else:
        raise bad(f"{where}.content", f"must be a string or an array of content parts, got {_json_type(content)}")
    out = {"role": role, "content": text}
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise bad(f"{where}.{key}", f"must be a string, got {_json_type(value)}")
            out[key] = value
    if role == "tool" and "tool_call_id" not in out:
        raise bad(f"{where}.tool_call_id", "is required on a message of role \"tool\" (the id of the call it "
                                          "answers)")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise bad(f"{where}.tool_calls", "is only allowed on assistant messages")
        calls = _list(calls, f"{where}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise bad(where, f"must be an array, got {_json_type(value)}")
    return value


def _tool_call(c: Any, where: str) -> dict:
    """A prior assistant turn's call: {"id", "type": "function", "function": {"name", "arguments"}}."""
    if not isinstance(c, dict):
        raise bad(where, f"must be a tool-call object, got {_json_type(c)}")
    fn = c.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function", "is required: {\"name\": ..., \"arguments\": \"{...}\"}")
    name, args = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.function.name", "is required and must be a string")
    if not isinstance(args, (str, dict)):
        raise bad(f"{where}.function.arguments", f"must be a JSON string, got {_json_type(args)}")
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    if c.get("id") is not None:
        if not isinstance(c["id"], str):
            raise bad(f"{where}.id", f"must be a string, got {_json_type(c['id'])}")
        out["id"] = c["id"]
    return out


# ---- responses ---------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else dumps(obj)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def completion_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]], offset0: int) -> dict:
    """Completions' logprobs object from (token text, logprob, [(alt text, alt logprob)]) per token. The sampled
    token is always part of its position's `top_logprobs`, as OpenAI documents."""
    tokens, lps, tops, offsets = [], [], [], []
    off = offset0
    for text, lp, alts in entries:
        tokens.append(text)
        lps.append(lp)
        top: dict[str, float] = {}
        for t, a in alts:                 # two tokens may print alike (partial UTF-8): keep the likelier
            top.setdefault(t, a)
        top.setdefault(text, lp)
        tops.append(top)
        offsets.append(off)
        off += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[tuple[str, bytes, float, list[tuple[str, bytes, float]]]]) -> dict:
    return {"content": [
        {"token": text, "logprob": lp, "bytes": list(raw),
         "top_logprobs": [{"token": t, "logprob": a, "bytes": list(r)} for t, r, a in alts]}
        for text, raw, lp, alts in entries]}
