"""The tool-calling and structured-output fields of a chat request: `tools`, `tool_choice`, `parallel_tool_calls`,
`response_format`, `reasoning_effort`, read field by field so that every error names the field it is about.

Errors are `FieldError` (a `kestrel.errors.RequestError` carrying `.param`): the server answers them with a 400 in
OpenAI's error shape, `param` set to the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from kestrel.errors import RequestError

# OpenAI's rule for function names; the chat encodings put the name inside markup (K2: `functions.NAME:0`, K3: an
# XTML attribute), so anything else would be ambiguous to parse back.
_NAME = re.compile(r"[A-Za-z0-9_\-.]{1,64}")
REASONING_EFFORTS = ("none", "low", "medium", "high", "max")


class FieldError(RequestError):
    """A bad request field; `param` is the field's path (`tools[0].function.parameters`)."""

    def __init__(self, param: str, why: str):
        super().__init__(f"`{param}` {why}")
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict            # a JSON schema of an object (`{"type": "object"}` when the request gave none)
    description: str | None = None
    strict: bool = False
    declaration: dict = field(default_factory=dict, compare=False)   # the request's tool object, declared as is


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None     # the forced function when mode == "function"


@dataclass(frozen=True)
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict | None = None  # json_schema only
    name: str | None = None
    strict: bool = False


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    response_format: ResponseFormat = ResponseFormat()
    reasoning_effort: str | None = None

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)


def parse_tool_request(body: dict) -> ToolRequest:
    """The tool / structured-output fields of a chat completion body (other fields are ignored here)."""
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    ptc = body.get("parallel_tool_calls", True)
    if not isinstance(ptc, bool):
        raise FieldError("parallel_tool_calls", "must be true or false")
    rf = parse_response_format(body.get("response_format"))
    if rf.type != "text" and choice.mode in ("required", "function"):
        raise FieldError("response_format", f"= {rf.type!r} cannot be combined with a `tool_choice` that forces a "
                                            "tool call; drop one of them")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise FieldError("reasoning_effort", f"= {effort!r} is not one of {', '.join(REASONING_EFFORTS)}")
    return ToolRequest(tuple(tools), choice, ptc, rf, effort)


def parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError("tools", "must be an array of tool objects")
    tools: list[Tool] = []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise FieldError(where, "must be an object like {\"type\": \"function\", \"function\": {...}}")
        if t.get("type", "function") != "function":
            raise FieldError(f"{where}.type", f"= {t.get('type')!r} is not supported; only \"function\" tools are")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise FieldError(f"{where}.function", "is required and must be an object with `name` and `parameters`")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise FieldError(f"{where}.function.name", "is required: 1 to 64 letters, digits, '_', '-' or '.'")
        if any(x.name == name for x in tools):
            raise FieldError(f"{where}.function.name", f"= {name!r} is declared twice; give each tool its own name")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise FieldError(f"{where}.function.description", "must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        check_schema(params, f"{where}.function.parameters", top_object=True)
        strict = fn.get("strict", False)
        if not isinstance(strict, bool):
            raise FieldError(f"{where}.function.strict", "must be true or false")
        tools.append(Tool(name, params, desc, strict, declaration=t))
    return tools


def parse_tool_choice(value: Any, tools: list[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise FieldError("tool_choice", f"= {value!r} is not one of none, auto, required, or "
                                            "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if value == "required" and not tools:
            raise FieldError("tool_choice", "= \"required\" needs at least one tool in `tools`")
        return ToolChoice(value)
    if isinstance(value, dict):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type", "function") != "function" or not isinstance(name, str):
            raise FieldError("tool_choice", "must name a function as {\"type\": \"function\", \"function\": "
                                            "{\"name\": ...}}")
        if not any(t.name == name for t in tools):
            known = ", ".join(t.name for t in tools) or "none"
            raise FieldError("tool_choice.function.name", f"= {name!r} is not one of the request's tools ({known})")
        return ToolChoice("function", name)
    raise FieldError("tool_choice", "must be a string or an object")


def parse_response_format(value: Any) -> ResponseFormat:
    if value is None:
        return ResponseFormat()
    if not isinstance(value, dict):
        raise FieldError("response_format", "must be an object like {\"type\": \"json_object\"}")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise FieldError("response_format.type", f"= {kind!r} is not one of text, json_object, json_schema")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise FieldError("response_format.json_schema", "is required for type json_schema: {\"name\": ..., "
                                                        "\"schema\": {...}}")
    schema = js.get("schema", {})
    check_schema(schema, "response_format.json_schema.schema")
    strict = js.get("strict", False)
    if not isinstance(strict, bool):
        raise FieldError("response_format.json_schema.strict", "must be true or false")
    name = js.get("name")
    return ResponseFormat("json_schema", schema, name if isinstance(name, str) else None, strict)


_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_schema(schema: Any, param: str, top_object: bool = False) -> None:
    """Reject what is not a JSON schema (the grammar compiler reports the rest when it compiles the schema)."""
    if isinstance(schema, bool):
        if top_object:
            raise FieldError(param, "must be a JSON schema object")
        return
    if not isinstance(schema, dict):
        raise FieldError(param, "must be a JSON schema object")
    try:
        json.dumps(schema)
    except (TypeError, ValueError):
        raise FieldError(param, "must be plain JSON") from None
    types = schema.get("type")
    for t in types if isinstance(types, list) else [types]:
        if t is not None and t not in _TYPES:
            raise FieldError(f"{param}.type", f"= {t!r} is not a JSON schema type ({', '.join(sorted(_TYPES))})")
    if top_object and types not in (None, "object"):
        raise FieldError(f"{param}.type", "must be \"object\": a function's parameters are an object")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise FieldError(f"{param}.properties", "must be an object of property schemas")
        for k, sub in props.items():
            check_schema(sub, f"{param}.properties.{k}")
    req = schema.get("required")
    if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
        raise FieldError(f"{param}.required", "must be an array of property names")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), (dict, bool)):
            check_schema(schema[key], f"{param}.{key}")
        elif key in schema:
            raise FieldError(f"{param}.{key}", "must be a schema object or a boolean")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise FieldError(f"{param}.{key}", "must be a non-empty array of schemas")
            for j, sub in enumerate(schema[key]):
                check_schema(sub, f"{param}.{key}[{j}]")
