"""The Kimi K2 / Kimi Linear chat encoding as code, producing segments (markup vs request text).

The checkpoints ship it as a Jinja template (`tokenizer_config.json`, read by `kestrel.tokenizer`); rendering that
to one string and encoding it with special tokens allowed would turn `<|im_end|>` inside a user message into the
control token. This module writes the same turns as segments instead. Format facts, as the public K2 templates and
parsers have them (moonshotai/Kimi-K2-Instruct `tokenizer_config.json`; vllm-project/vllm
`vllm/tool_parsers/kimi_k2_tool_parser.py`; Moonshot's K2 tool-call guidance):

    [<|im_system|>tool_declare<|im_middle|>{json.dumps(tools)}<|im_end|>]
    [<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>]  (no system)
    <|im_user|>{name or "user"}<|im_middle|>{content}<|im_end|>
    <|im_assistant|>{name or "assistant"}<|im_middle|>{content}
        <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{args}
        <|tool_call_end|>...<|tool_calls_section_end|><|im_end|>
    <|im_system|>{name or "tool"}<|im_middle|>## Return of {tool_call_id}\n{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                      (generation prompt)

Tool-call ids are `functions.NAME:IDX` with IDX counting calls over the whole conversation; ids of other shapes in
the history (an OpenAI client's own) are renumbered, and tool results follow their call's new id.

Thinking checkpoints (K2 Thinking / K2.5 templates) wrap each assistant turn's reasoning in `<think>..</think>`:
the turns after the last user message keep their `reasoning_content`, earlier ones get an empty pair, and the
generation prompt opens `<think>` (or closes it at once when thinking is off). `thinking=None` is the instruct form
(Kimi Linear Instruct, K2 Instruct): no think markup at all.
"""

from __future__ import annotations

import json
import re

from kestrel.serve.chat.markup import (ARGS_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, THINK_CLOSE,
                                       THINK_OPEN)
from kestrel.serve.chat.prompt import ChatPrompt, call_name, content_text, markup, text
from kestrel.serve.chat.request import FieldError

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
_K2_ID = re.compile(r"functions\.(.+):(\d+)")
_HEADER = {"system": "<|im_system|>", "developer": "<|im_system|>", "user": "<|im_user|>",
           "assistant": "<|im_assistant|>"}


def arguments_text(call: dict, where: str) -> str:
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        return args
    try:
        return json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError):
        raise FieldError(f"{where}.function.arguments", "must be a JSON string or object") from None


def encode_k2(messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
              thinking: bool | None = None) -> ChatPrompt:
    """Segments of a K2 / Kimi Linear chat; `tools` are the request's tool objects (declared as given)."""
    p = ChatPrompt("kimi_k2", merge_text=True)
    if tools:
        p.add(markup("<|im_system|>"), text("tool_declare"), markup("<|im_middle|>"),
              text(json.dumps(tools, ensure_ascii=False)), markup("<|im_end|>"))
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    ids: dict[str, str] = {}        # history tool_call id -> the K2 id it is rendered as
    counter = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if i == 0 and role not in ("system", "developer"):
            p.add(markup("<|im_system|>"), text("system"), markup("<|im_middle|>"), text(DEFAULT_SYSTEM),
                  markup("<|im_end|>"))
        name = m.get("name") if isinstance(m.get("name"), str) and m.get("name") else role
        p.add(markup(_HEADER.get(role, "<|im_system|>")), text(name), markup("<|im_middle|>"))
        content = content_text(m.get("content"), where)
        if role == "assistant":
            if thinking is not None:
                reasoning = m.get("reasoning_content") if i > last_user else None
                p.add(markup(THINK_OPEN), text(reasoning if isinstance(reasoning, str) else ""),
                      markup(THINK_CLOSE))
            p.add(text(content))
            calls = m.get("tool_calls") or []
            if calls:
                p.add(markup(SECTION_BEGIN))
                for j, call in enumerate(calls):
                    cw = f"{where}.tool_calls[{j}]"
                    cname = call_name(call, cw)
                    given = call.get("id")
                    match = _K2_ID.fullmatch(given) if isinstance(given, str) else None
                    if match and match.group(1) == cname:
                        k2_id, counter = given, max(counter, int(match.group(2)) + 1)
                    else:
                        k2_id, counter = f"functions.{cname}:{counter}", counter + 1
                    if isinstance(given, str):
                        ids[given] = k2_id
                    p.add(markup(CALL_BEGIN), text(k2_id), markup(ARGS_BEGIN), text(arguments_text(call, cw)),
                          markup(CALL_END))
                p.add(markup(SECTION_END))
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise FieldError(f"{where}.tool_call_id", "is required on a tool message")
            p.add(text(f"## Return of {ids.get(call_id, call_id)}\n"), text(content))
        else:
            p.add(text(content))
        p.add(markup("<|im_end|>"))
    if add_generation_prompt:
        p.add(markup("<|im_assistant|>"), text("assistant"), markup("<|im_middle|>"))
        if thinking is True:
            p.add(markup(THINK_OPEN))
            p.opens_reasoning = True
        elif thinking is False:
            p.add(markup(THINK_OPEN), markup(THINK_CLOSE))
    p.next_call_index = counter
    return p
