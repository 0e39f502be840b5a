"""Reasoning parsers (`--reasoning-parser kimi_k2 | kimi_k3`): split the model's thinking from the rest.

Input: output items (`markup.Item`); output: `(is_reasoning, item)` pairs. Reasoning is text only; everything that
is not reasoning goes on, markup included, to the tool parser. Markers (token-level, from the public parsers:
vllm-project/vllm `vllm/reasoning/kimi_k2_reasoning_parser.py`, `vllm/reasoning/kimi_k3_reasoning_parser.py`):

- kimi_k2: `<think>` ... `</think>` (special tokens on K2 Thinking / K2.5).
- kimi_k3: `<|open|>think<|sep|>` ... `<|close|>think<|sep|>`.

`starts_in_reasoning`: the prompt's generation prefix already opened the thinking channel (the chat encoding says
so in `ChatPrompt.opens_reasoning`), so output starts inside it with no open marker.

A model that never closes its thinking must not lose its answer: the start of a tool-call section (K2
`<|tool_calls_section_begin|>` / `<|tool_call_begin|>`; K3 a `response`, `tools` or `call` tag) ends the reasoning
as if the end marker had come, and that markup goes on to the tool parser. Output that ends still inside the
thinking channel is reasoning (`reasoning_content`), never dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

from kestrel.serve.chat.markup import CALL_BEGIN, SECTION_BEGIN, THINK_CLOSE, THINK_OPEN, Item, Special, Tag, raw_text


class ReasoningParser(ABC):
    def __init__(self, starts_in_reasoning: bool = False):
        self.in_reasoning = starts_in_reasoning
        self._content_seen = False

    def feed(self, items: Iterable[Item]) -> list[tuple[bool, Item]]:
        out: list[tuple[bool, Item]] = []
        for it in items:
            if self.in_reasoning:
                if self._is_close(it):
                    self.in_reasoning = False
                elif self._ends_implicitly(it):
                    self.in_reasoning = False
                    out.append((False, it))
                elif isinstance(it, str):
                    out.append((True, it))
                elif isinstance(it, Tag):
                    out.append((True, it.raw))         # other markup inside thinking is thinking text
                else:
                    out.append((False, it))            # a control token: the tool parser decides
                continue
            if self._is_open(it) and not self._content_seen:
                self.in_reasoning = True
                continue
            if not (isinstance(it, str) and not it.strip()):
                self._content_seen = True
            out.append((False, it))
        return out

    def finish(self) -> list[tuple[bool, Item]]:
        return []

    @abstractmethod
    def _is_open(self, it: Item) -> bool:
        ...

    @abstractmethod
    def _is_close(self, it: Item) -> bool:
        ...

    @abstractmethod
    def _ends_implicitly(self, it: Item) -> bool:
        ...


class KimiK2ReasoningParser(ReasoningParser):
    def _is_open(self, it: Item) -> bool:
        return isinstance(it, Special) and it.raw == THINK_OPEN

    def _is_close(self, it: Item) -> bool:
        return isinstance(it, Special) and it.raw == THINK_CLOSE

    def _ends_implicitly(self, it: Item) -> bool:
        return isinstance(it, Special) and it.raw in (SECTION_BEGIN, CALL_BEGIN)


class KimiK3ReasoningParser(ReasoningParser):
    def _is_open(self, it: Item) -> bool:
        return isinstance(it, Tag) and not it.close and it.name == "think"

    def _is_close(self, it: Item) -> bool:
        return isinstance(it, Tag) and it.close and it.name == "think"

    def _ends_implicitly(self, it: Item) -> bool:
        return isinstance(it, Tag) and not it.close and it.name in ("response", "tools", "call")


REASONING_PARSERS = {"kimi_k2": KimiK2ReasoningParser, "kimi_k3": KimiK3ReasoningParser}


def split_reasoning(parser: ReasoningParser, items: Iterable[Item]) -> tuple[str, list[Item]]:
    """Non-streaming: (reasoning text, the other items)."""
    pairs = parser.feed(items) + parser.finish()
    return "".join(raw_text(i) for r, i in pairs if r), [i for r, i in pairs if not r]
