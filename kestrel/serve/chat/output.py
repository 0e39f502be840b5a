"""One request's output parser: lexer -> reasoning parser -> tool parser, and the OpenAI shapes of what they find.

    parser = ChatOutputParser("kimi_k3", tokenizer, reasoning=True, tools=True,
                              starts_in_reasoning=prompt.opens_reasoning)
    for ids in new_token_batches:                 # streaming
        for delta in parser.feed_ids(ids):        # {"reasoning_content": ..} / {"content": ..} / {"tool_calls": [..]}
            send(delta)
    for delta in parser.finish(): send(delta)
    parser.message()                              # the whole assistant message (non-streaming response)
    parser.finish_reason(engine_reason)           # "tool_calls" when a call was made and the model stopped

Streaming deltas and `message()` come from the same events, so the two always agree: the concatenated
`content` / `reasoning_content` deltas are the message's, and a call's `arguments` fragments concatenate to its
`function.arguments`.
"""

from __future__ import annotations

from typing import Iterable

from kestrel.serve.chat.markup import (ARGS_BEGIN, CALL_BEGIN, CALL_END, CLOSE, END_OF_MSG, OPEN, SECTION_BEGIN,
                                       SECTION_END, SEP, THINK_CLOSE, THINK_OPEN, IdLexer, Item, TextLexer, XtmlLexer,
                                       raw_text)
from kestrel.serve.chat.reasoning_parsers import REASONING_PARSERS
from kestrel.serve.chat.tool_parsers import TOOL_PARSERS, IdFactory

FAMILIES = ("kimi_k2", "kimi_k3")
_SPELLINGS = {
    "kimi_k2": (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END, THINK_OPEN, THINK_CLOSE, "<|im_end|>"),
    "kimi_k3": (OPEN, CLOSE, SEP, END_OF_MSG),
}


class ChatOutputParser:
    def __init__(self, family: str, tokenizer=None, *, reasoning: bool = True, tools: bool = True,
                 starts_in_reasoning: bool = False, id_factory: IdFactory | None = None):
        if family not in FAMILIES:
            raise ValueError(f"unknown chat family {family!r}; one of {', '.join(FAMILIES)}")
        self.family = family
        self._ids = IdLexer(tokenizer) if tokenizer is not None else None
        self._text = TextLexer(_SPELLINGS[family])
        self._xtml = XtmlLexer() if family == "kimi_k3" else None
        self._reasoning = REASONING_PARSERS[family](starts_in_reasoning) if reasoning else None
        self._tools = TOOL_PARSERS[family](enabled=tools, id_factory=id_factory)
        self.reasoning_text = ""
        self.content_text = ""
        self.calls: list[dict] = []
        self._finished = False

    # ---- input ---------------------------------------------------------------------------------------------
    def feed_ids(self, ids: Iterable[int]) -> list[dict]:
        if self._ids is None:
            raise ValueError("this parser was built without a tokenizer; use feed_text")
        return self._items(self._ids.feed(ids))

    def feed_text(self, text: str) -> list[dict]:
        return self._items(self._text.feed(text))

    def finish(self) -> list[dict]:
        if self._finished:
            return []
        self._finished = True
        items = (self._ids.finish() if self._ids is not None else []) + self._text.finish()
        return self._items(items, final=True)

    def _items(self, items: list[Item], final: bool = False) -> list[dict]:
        if self._xtml is not None:
            items = self._xtml.feed(items) + (self._xtml.finish() if final else [])
        events: list[tuple] = []
        if self._reasoning is not None:
            pairs = self._reasoning.feed(items) + (self._reasoning.finish() if final else [])
            content: list[Item] = []
            for is_r, it in pairs:
                if is_r:
                    events.extend(self._tools.feed(content))
                    content = []
                    events.append(("reasoning", raw_text(it)))
                else:
                    content.append(it)
            events.extend(self._tools.feed(content))
        else:
            events.extend(self._tools.feed(items))
        if final:
            events.extend(self._tools.finish())
        return self._deltas(events)

    # ---- output --------------------------------------------------------------------------------------------
    def _deltas(self, events: list[tuple]) -> list[dict]:
        """Events -> OpenAI delta objects, adjacent text of one kind merged, order kept."""
        out: list[dict] = []
        for ev in events:
            kind = ev[0]
            if kind in ("reasoning", "content"):
                key = "reasoning_content" if kind == "reasoning" else "content"
                if kind == "reasoning":
                    self.reasoning_text += ev[1]
                else:
                    self.content_text += ev[1]
                if out and set(out[-1]) == {key}:
                    out[-1][key] += ev[1]
                else:
                    out.append({key: ev[1]})
            elif kind == "call":
                _, index, call_id, name = ev
                self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
                out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            else:
                _, index, frag = ev
                self.calls[index]["function"]["arguments"] += frag
                last = out[-1]["tool_calls"][-1] if out and "tool_calls" in out[-1] else None
                if last is not None and last["index"] == index:
                    last["function"]["arguments"] += frag
                else:
                    out.append({"tool_calls": [{"index": index, "function": {"arguments": frag}}]})
        return out

    def message(self) -> dict:
        """The assistant message of a non-streaming response (call after `finish()`)."""
        msg: dict = {"role": "assistant", "content": self.content_text or None}
        if self.reasoning_text:
            msg["reasoning_content"] = self.reasoning_text
        if self.calls:
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self.calls]
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when the model called a tool and stopped on its own."""
        if self.calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def parse_ids(family: str, tokenizer, ids: Iterable[int], **kwargs) -> ChatOutputParser:
    """Non-streaming: parse a whole output; read `.message()`."""
    p = ChatOutputParser(family, tokenizer, **kwargs)
    p.feed_ids(ids)
    p.finish()
    return p


def parse_text(family: str, text: str, **kwargs) -> ChatOutputParser:
    p = ChatOutputParser(family, **kwargs)
    p.feed_text(text)
    p.finish()
    return p
