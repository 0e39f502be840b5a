"""A chat prompt as segments: each segment is either template markup (encoded with special tokens allowed) or text
(encoded as plain text, whatever it contains). Text from a request is only ever a text segment, so a user who writes
`<|im_end|>` or `<|open|>` gets those characters, never the control token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kestrel.serve.chat.request import FieldError


@dataclass(frozen=True)
class Segment:
    text: str
    markup: bool = False    # True: the encoding's own markup, encode with allow_special=True


def markup(text: str) -> Segment:
    return Segment(text, True)


def text(value: str) -> Segment:
    return Segment(value, False)


@dataclass
class ChatPrompt:
    """What a chat encoding produces.

    `merge_text`: adjacent text segments are encoded as one run (K2's Jinja template is tokenized as one string
    split at its special tokens, so BPE runs across its text pieces); K3's encoder tokenizes each segment on its own.
    `opens_reasoning`: the prompt ends inside the thinking channel (the reasoning parser starts in reasoning).
    `next_call_index`: K2 numbers tool calls across the conversation (`functions.NAME:IDX`); the next call's IDX.
    """

    family: str
    segments: list[Segment] = field(default_factory=list)
    merge_text: bool = False
    opens_reasoning: bool = False
    next_call_index: int = 0

    def add(self, *segs: Segment) -> None:
        self.segments.extend(s for s in segs if s.text)

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)

    def runs(self) -> list[Segment]:
        """The segments as they are encoded: one per markup piece, text merged where `merge_text`."""
        if not self.merge_text:
            return list(self.segments)
        runs: list[Segment] = []
        for s in self.segments:
            if runs and not s.markup and not runs[-1].markup:
                runs[-1] = Segment(runs[-1].text + s.text, False)
            else:
                runs.append(s)
        return runs

    def token_ids(self, tokenizer) -> list[int]:
        ids: list[int] = []
        for s in self.runs():
            ids.extend(tokenizer.encode(s.text, allow_special=s.markup))
        return ids


# ---- reading request messages (both encodings) ---------------------------------------------------------------

def content_text(content: Any, where: str) -> str:
    """A message's content as one string (text parts concatenated)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise FieldError(f"{where}.content[{j}]", "must be a text part {\"type\": \"text\", \"text\": ...}")
            parts.append(part["text"])
        return "".join(parts)
    raise FieldError(f"{where}.content", "must be a string or an array of text parts")


def call_name(call: Any, where: str) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise FieldError(f"{where}.function.name", "is required")
    return name
