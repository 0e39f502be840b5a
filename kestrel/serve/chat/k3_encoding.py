"""The Kimi K3 chat encoding (XTML) as code: messages, tools and options -> segments.

K3's chat encoding is a program, not a Jinja template. Format facts, as Moonshot's reference encoder has them
(`encoding_k3.py` of moonshotai/Kimi-K3, carried in vllm-project/vllm `vllm/tokenizers/encoding_k3.py`; the
parsers in `vllm/tool_parsers/kimi_k3_tool_parser.py` and `vllm/reasoning/kimi_k3_reasoning_parser.py`):

- Four control tokens: `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`. A tag is `<|open|>NAME ATTRS<|sep|>` /
  `<|close|>NAME<|sep|>`; NAME and ATTRS (` key="value"`, value with `&` -> `&amp;`, `"` -> `&quot;`) are plain
  text. Every `_text` piece of the reference is its own segment and is tokenized on its own.
- A message: `<|open|>message role="R"[ name="N"]<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>`.
- Tools are declared first, in a system message of type "tool-declare", as compact key-sorted JSON; then, when
  thinking, a system message of type "thinking-effort".
- An assistant body: `think` channel (thinking mode only, empty when there is no reasoning), `response` channel,
  then a `tools` channel of `call tool="NAME" index="k"` elements (k from 1) holding one `argument key="K"
  type="T"` per argument: strings raw, other values as JSON; arguments that are not a JSON object go in one
  `json type="object"` element instead.
- A tool result: `<|open|>message role="tool" tool="NAME" index="k"<|sep|>CONTENT...`, k the position of its call
  in the preceding assistant message (matched by `tool_call_id`).
- `tool_choice` required / none and `response_format` json_object / json_schema become system messages of types
  "tool-choice" / "response-format" after the conversation.
- The generation prompt opens the assistant message and then the `think` channel (thinking) or the `response`
  channel (not thinking). Thinking is on unless `reasoning_effort="none"`; effort low / high / max (default max).
"""

from __future__ import annotations

import json
from typing import Any

from kestrel.serve.chat.markup import CLOSE, END_OF_MSG, OPEN, SEP
from kestrel.serve.chat.prompt import ChatPrompt, Segment, call_name, content_text, markup, text
from kestrel.serve.chat.request import FieldError

EFFORTS = ("low", "high", "max")

_EFFORT_NOTE = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
                "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={}`.")
_TOOLS_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
_DYNAMIC_TOOLS_HEAD = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                       "You have access to all existing and extended tools.\nHere are the specs for the extended "
                       "tools.\n\n")
_CHOICE_NOTE = {"required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next "
                            "message.",
                "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next "
                        "message."}
_RAW_JSON = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
             "formatting.")


def thinking_options(reasoning_effort: str | None) -> tuple[bool, str]:
    """(thinking, effort) for a request's `reasoning_effort`."""
    if reasoning_effort == "none":
        return False, "max"
    effort = reasoning_effort or "max"
    if effort not in EFFORTS:
        raise FieldError("reasoning_effort", f"= {effort!r} is not supported by Kimi K3; use low, high, max or none")
    return True, effort


def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def open_tag(name: str, *attrs: tuple[str, Any]) -> list[Segment]:
    segs = [markup(OPEN), text(name)]
    for key, value in attrs:
        segs += [text(f" {key}"), text('="'), text(_escape(value)), text('"')]
    return segs + [markup(SEP)]


def close_tag(name: str) -> list[Segment]:
    return [markup(CLOSE), text(name), markup(SEP)]


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _system(kind: str, body: str) -> list[Segment]:
    return [*open_tag("message", ("role", "system"), ("type", kind)), text(body.strip()), *close_tag("message"),
            markup(END_OF_MSG)]


def _declare(tools: list, dynamic: bool = False) -> list[Segment]:
    head = _DYNAMIC_TOOLS_HEAD if dynamic else _TOOLS_HEAD
    return [*open_tag("message", ("role", "system"), ("type", "tool-declare")),
            text(f"{head}```json\n{_compact(tools)}\n```"), *close_tag("message"), markup(END_OF_MSG)]


def _arguments(call: dict, where: str) -> tuple[dict, str | None]:
    """(arguments as an object, None) or ({}, raw text) for arguments that are not JSON."""
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}, None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {}, fn["arguments"]
    if not isinstance(args, dict):
        raise FieldError(f"{where}.function.arguments", "must be a JSON object")
    return args, None


def _assistant(m: dict, where: str, thinking: bool) -> list[Segment]:
    segs: list[Segment] = []
    if thinking:
        reasoning = m.get("reasoning_content")
        segs += open_tag("think")
        if isinstance(reasoning, str) and reasoning.strip():
            segs.append(text(reasoning))
        segs += close_tag("think")
    segs += [*open_tag("response"), text(content_text(m.get("content"), where)), *close_tag("response")]
    calls = m.get("tool_calls") or []
    if calls:
        segs += open_tag("tools")
        for k, call in enumerate(calls, 1):
            cw = f"{where}.tool_calls[{k - 1}]"
            segs += open_tag("call", ("tool", call_name(call, cw)), ("index", k))
            args, raw = _arguments(call, cw)
            if raw is not None:
                segs += [*open_tag("json", ("type", "object")), text(raw), *close_tag("json")]
            for key, value in args.items():
                value_text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
                segs += [*open_tag("argument", ("key", key), ("type", xtml_type(value))), text(value_text),
                         *close_tag("argument")]
            segs += close_tag("call")
        segs += close_tag("tools")
    return segs


def _tool_results(messages: list[dict]) -> list[tuple[int, dict, str | None, int]]:
    """(message index, message, tool name, 1-based call position) for every tool message, each run of tool
    messages put in the order of the preceding assistant's calls when every one of them matches a call id."""
    out: list[tuple[int, dict, str | None, int]] = []
    calls: list = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") == "assistant":
            calls = m.get("tool_calls") or []
        if m.get("role") != "tool":
            i += 1
            continue
        by_id = {c.get("id"): (k, c) for k, c in enumerate(calls, 1) if isinstance(c, dict) and c.get("id")}
        run = []
        while i < len(messages) and messages[i].get("role") == "tool":
            run.append((i, messages[i], by_id.get(messages[i].get("tool_call_id"))))
            i += 1
        if all(match is not None for _, _, match in run):
            run.sort(key=lambda r: r[2][0])
        for pos, (j, tm, match) in enumerate(run, 1):
            if match is not None:
                name = call_name(match[1], f"messages[{j}]")
                pos = match[0]
            else:
                name = tm.get("name") or tm.get("tool")
                if name is None and pos <= len(calls):
                    name = call_name(calls[pos - 1], f"messages[{j}]")
            out.append((j, tm, name, pos))
    return out


def encode_k3(messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
              reasoning_effort: str | None = None, tool_choice: str | None = None,
              response_format: dict | None = None) -> ChatPrompt:
    """Segments of a K3 chat. `tool_choice` is "none" / "auto" / "required" (a named choice adds no note: the
    grammar forces the call); `response_format` the request's object."""
    thinking, effort = thinking_options(reasoning_effort)
    p = ChatPrompt("kimi_k3", merge_text=False)
    if tools:
        p.add(*_declare(tools))
    if thinking:
        p.add(*_system("thinking-effort", _EFFORT_NOTE.format(effort)))
    # tool results in the order they are written: each run of them sorted into its calls' order
    results = iter(_tool_results(messages))
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        named = [("name", m["name"])] if isinstance(m.get("name"), str) and m.get("name") else []
        if role == "tool":
            j, tm, name, pos = next(results)
            if name is None:
                raise FieldError(f"messages[{j}]", "is a tool result whose tool is unknown: give `tool_call_id` of "
                                                   "a preceding assistant tool call, or `name`")
            p.add(*open_tag("message", ("role", "tool"), ("tool", name), ("index", pos)),
                  text(content_text(tm.get("content"), f"messages[{j}]")), *close_tag("message"),
                  markup(END_OF_MSG))
            continue
        if role in ("system", "developer") and m.get("tools"):
            p.add(*_declare(m["tools"], dynamic=True))
            continue
        if role == "assistant":
            body = _assistant(m, where, thinking)
        else:
            body = [text(content_text(m.get("content"), where))]
        tag_role = "system" if role == "developer" else role
        p.add(*open_tag("message", ("role", tag_role), *named), *body, *close_tag("message"), markup(END_OF_MSG))
    if tool_choice in _CHOICE_NOTE:
        p.add(*_system("tool-choice", _CHOICE_NOTE[tool_choice]))
    rf_type = (response_format or {}).get("type")
    if rf_type == "json_object":
        p.add(*_system("response-format", f"The system is invoked with `response_format=json_object`.\n{_RAW_JSON}"))
    elif rf_type == "json_schema":
        schema = ((response_format or {}).get("json_schema") or {}).get("schema", {})
        p.add(*_system("response-format", f"The system is invoked with `response_format=json_schema`.\n{_RAW_JSON}\n"
                                          f"The JSON data must match the following schema:\n"
                                          f"```json\n{_compact(schema)}\n```"))
    if add_generation_prompt:
        p.add(*open_tag("message", ("role", "assistant")), *open_tag("think" if thinking else "response"))
        p.opens_reasoning = thinking
    return p
