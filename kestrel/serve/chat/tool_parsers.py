"""Tool-call parsers (`--tool-call-parser kimi_k2 | kimi_k3`): content items -> content text and tool calls.

Streaming first: `feed(items)` returns events as soon as they are certain, `finish()` flushes. Events:
`("content", text)`, `("call", index, id, name)` once per call when its header is complete, then
`("args", index, fragment)` pieces whose concatenation is the call's `function.arguments` JSON string. The
non-streaming result is the same events collected (`output.ChatOutputParser`), so both paths always agree.

Formats (token-level; public parsers: vllm-project/vllm `vllm/tool_parsers/kimi_k2_tool_parser.py` and
`vllm/tool_parsers/kimi_k3_tool_parser.py`):

- kimi_k2: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>`, then `<|tool_calls_section_end|>`. The call id is the
  header, `functions.NAME:IDX` (the id K2's template writes back in later turns).
- kimi_k3: a `tools` channel `<|open|>tools<|sep|>` of `<|open|>call tool="NAME" index="k"<|sep|>` elements, each
  holding `<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>` (a string VALUE is raw text,
  other types are JSON) or one `<|open|>json type="object"<|sep|>{raw}<|close|>json<|sep|>`; text of the
  `response` channel is content. Typed arguments are converted to one JSON object as they stream.

Malformed or truncated output is never lost: a call header that does not parse, a stray text inside a section, an
unfinished header at the end are returned as content text (raw). A call whose arguments were cut off (max_tokens)
keeps the arguments it had; the finish reason ("length") tells the client. With `enabled=False` (tool_choice
"none", no tools) tool markup is returned as content text as it was written.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
from abc import ABC, abstractmethod
from typing import Callable, Iterable

from kestrel.serve.chat.markup import (ARGS_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, Item, Special,
                                       Tag, raw_text)

Event = tuple
IdFactory = Callable[[int, str], str]
_K2_HEADER = re.compile(r"\s*(?:functions\.)?([^\s:]+?)(?::(\d+))?\s*")
_K2_MARKUP = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)


def random_call_id(index: int, name: str) -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolParser(ABC):
    def __init__(self, enabled: bool = True, id_factory: IdFactory | None = None):
        self.enabled = enabled
        self.id_factory = id_factory
        self.num_calls = 0
        self._events: list[Event] = []

    def feed(self, items: Iterable[Item]) -> list[Event]:
        for it in items:
            self._item(it)
        out, self._events = self._events, []
        return out

    def finish(self) -> list[Event]:
        self._finish()
        out, self._events = self._events, []
        return out

    def _content(self, s: str) -> None:
        if s:
            self._events.append(("content", s))

    def _start_call(self, name: str, call_id: str | None = None) -> None:
        index = self.num_calls
        self.num_calls += 1
        if call_id is None:
            call_id = (self.id_factory or random_call_id)(index, name)
        self._events.append(("call", index, call_id, name))

    def _args(self, fragment: str) -> None:
        if fragment:
            self._events.append(("args", self.num_calls - 1, fragment))

    @abstractmethod
    def _item(self, it: Item) -> None:
        ...

    @abstractmethod
    def _finish(self) -> None:
        ...


class KimiK2ToolParser(ToolParser):
    """States: text, section (between calls), header (after `<|tool_call_begin|>`), args, raw (a malformed call's
    arguments, returned as text)."""

    def __init__(self, enabled: bool = True, id_factory: IdFactory | None = None):
        super().__init__(enabled, id_factory)
        self.state = "text"
        self._header = ""
        self._args_started = False

    def _item(self, it: Item) -> None:
        if not self.enabled:
            if isinstance(it, str) or it.raw in _K2_MARKUP:
                self._content(raw_text(it))
            return
        special = it.raw if isinstance(it, Special) else None
        st = self.state
        if st == "header":
            if special is None:
                self._header += it
            elif special == ARGS_BEGIN:
                self._open_call()
            else:                                   # header cut short by another token: give it back as text
                self._content(CALL_BEGIN + self._header)
                self.state = "section"
                self._item(it)
            return
        if st in ("args", "raw"):
            if special is None:
                if st == "raw":
                    self._content(it)
                else:
                    frag = it if self._args_started else it.lstrip()
                    self._args_started = self._args_started or bool(frag)
                    self._args(frag)
                return
            if st == "raw" and special == CALL_END:
                self._content(special)              # the malformed call's own end, echoed with it
            self.state = "section"
            if special == CALL_END:
                return
            self._item(it)                          # a missing <|tool_call_end|>: the next token decides
            return
        if special is None:
            if st == "section" and not it.strip():
                return
            self._content(it)
        elif special == SECTION_BEGIN:
            self.state = "section"
        elif special == SECTION_END:
            self.state = "text"
        elif special == CALL_BEGIN:
            self.state, self._header = "header", ""
        elif special in (ARGS_BEGIN, CALL_END):
            self._content(special)                 # out of place: keep it visible rather than guess
        # other control tokens (turn ends) carry no text

    def _open_call(self) -> None:
        m = _K2_HEADER.fullmatch(self._header)
        if m is None:
            self._content(CALL_BEGIN + self._header + ARGS_BEGIN)
            self.state = "raw"
            return
        name, idx = m.group(1), m.group(2)
        self._start_call(name, f"functions.{name}:{idx if idx is not None else self.num_calls}")
        self.state, self._args_started = "args", False

    def _finish(self) -> None:
        if self.state == "header":
            self._content(CALL_BEGIN + self._header)
        self.state = "text"


class KimiK3ToolParser(ToolParser):
    """Tracks the XTML element stack that matters: tools > call > argument | json."""

    def __init__(self, enabled: bool = True, id_factory: IdFactory | None = None):
        super().__init__(enabled, id_factory)
        self.in_tools = False
        self.call: str | None = None        # "ok" inside a parsed call, "raw" inside a call that did not parse
        self.arg: str | None = None         # "string", "value" (buffered JSON), "json" (raw arguments block)
        self._value = ""
        self._n_args = 0
        self._raw_depth = 0                 # tools disabled: open tools elements being echoed as text

    def _item(self, it: Item) -> None:
        if not self.enabled:
            self._echo(it)
            return
        if isinstance(it, str):
            self._text(it)
        elif isinstance(it, Tag):
            self._tag(it)
        # bare control tokens (<|end_of_msg|>) carry no text

    def _echo(self, it: Item) -> None:
        if isinstance(it, Tag) and it.name == "tools":
            self._raw_depth += -1 if it.close else 1
            self._content(it.raw)
        elif self._raw_depth > 0:
            self._content(raw_text(it))
        elif isinstance(it, str):
            self._content(it)
        elif isinstance(it, Tag) and it.name not in ("response", "message", "think"):
            self._content(it.raw)

    def _text(self, s: str) -> None:
        if self.call == "raw":
            self._content(s)
        elif self.arg == "string":
            self._args(json.dumps(s, ensure_ascii=False)[1:-1])
        elif self.arg == "value":
            self._value += s
        elif self.arg == "json":
            self._args(s)
        elif self.call == "ok" or (self.in_tools and not s.strip()):
            if s.strip():
                self._content(s)            # stray text between arguments: shown, not dropped
        else:
            self._content(s)

    def _tag(self, t: Tag) -> None:
        if self.call == "raw":
            self._content(t.raw)
            if t.close and t.name == "call":
                self.call = None
            return
        if t.name == "argument" or t.name == "json":
            if self.call is None:
                self._content(t.raw)
                return
            self._close_arg()
            if not t.close:
                self._open_arg(t)
            return
        if t.name == "call":
            self._close_call()
            if not t.close:
                self._open_call(t)
            return
        if t.name == "tools":
            self._close_call()
            self.in_tools = not t.close
            return
        if t.name in ("response", "message", "think"):
            self._close_call()
            self.in_tools = False
            return
        self._content(t.raw)                # an element this format does not have

    def _open_call(self, t: Tag) -> None:
        name = t.attrs.get("tool", "")
        if not name:
            self.call = "raw"
            self._content(t.raw)
            return
        self.in_tools = True
        self.call, self._n_args = "ok", 0
        self._start_call(name)

    def _open_arg(self, t: Tag) -> None:
        if t.name == "json":
            if self._n_args == 0:
                self.arg = "json"
                self._n_args = -1           # a json block is the whole arguments string
            else:
                self._content(t.raw)
            return
        if self._n_args < 0:
            self._content(t.raw)
            return
        key = t.attrs.get("key", "")
        self._args(("{" if self._n_args == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": ")
        self._n_args += 1
        if t.attrs.get("type", "string") == "string":
            self.arg = "string"
            self._args('"')
        else:
            self.arg, self._value = "value", ""

    def _close_arg(self) -> None:
        if self.arg == "string":
            self._args('"')
        elif self.arg == "value":
            v = self._value.strip()
            try:
                json.loads(v)
            except ValueError:
                v = json.dumps(self._value, ensure_ascii=False)     # not JSON after all: keep it as a string
            self._args(v)
        self.arg = None

    def _close_call(self) -> None:
        if self.call != "ok":
            return
        self._close_arg()
        if self._n_args == 0:
            self._args("{}")
        elif self._n_args > 0:
            self._args("}")
        self.call = None

    def _finish(self) -> None:
        if self.arg == "value":             # cut off inside a typed value: keep the text it had
            self._args(self._value)
        self.arg = None


TOOL_PARSERS = {"kimi_k2": KimiK2ToolParser, "kimi_k3": KimiK3ToolParser}


def sequential_ids(prefix: str = "call") -> IdFactory:
    """Deterministic ids (`{prefix}_0`, ...): tests, and servers that derive ids from the request id."""
    counter = itertools.count()
    return lambda index, name: f"{prefix}_{next(counter)}"
