"""Model output as a stream of items: text, control tokens, and (K3) XTML tags.

Parsing works on token ids where it can: a control token the model sampled is a `Special`, while the same characters
spelled out in text stay text, so a string argument that contains `<|close|>argument<|sep|>` cannot end an argument.
`IdLexer` turns ids into items (UTF-8 held back across tokens); `TextLexer` does the same for text that still holds
the control tokens' spellings (a server that only has text), holding back a tail that may be the start of one.
`XtmlLexer` folds K3's `<|open|>NAME ATTRS<|sep|>` / `<|close|>NAME<|sep|>` into `Tag`s.
Every item keeps its `raw` text, so a structure that turns out malformed can be given back as text.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field
from typing import Iterable, Union


@dataclass(frozen=True)
class Special:
    raw: str            # the control token's text, e.g. "<|tool_call_begin|>"


@dataclass(frozen=True)
class Tag:
    close: bool
    name: str
    attrs: dict = field(default_factory=dict)
    raw: str = ""


Item = Union[str, Special, Tag]


def raw_text(item: Item) -> str:
    return item if isinstance(item, str) else item.raw


def _push_text(out: list[Item], s: str) -> None:
    if not s:
        return
    if out and isinstance(out[-1], str):
        out[-1] += s
    else:
        out.append(s)


class IdLexer:
    """Token ids -> items. Ids the tokenizer has no piece for (past its size, below the model's vocabulary) carry
    no text and are dropped."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> list[Item]:
        out: list[Item] = []
        for i in ids:
            if self.tok.is_special(i):
                _push_text(out, self._utf8.decode(b"", final=True))
                out.append(Special(self.tok.id_to_piece(i).decode("utf-8", "replace")))
                continue
            try:
                piece = self.tok.id_to_piece(i)
            except ValueError:
                continue
            _push_text(out, self._utf8.decode(piece))
        return out

    def finish(self) -> list[Item]:
        out: list[Item] = []
        _push_text(out, self._utf8.decode(b"", final=True))
        return out


class TextLexer:
    """Text that spells control tokens -> items; `specials` are the control-token spellings to recognize."""

    def __init__(self, specials: Iterable[str]):
        names = sorted(set(specials), key=len, reverse=True)
        self._re = re.compile("|".join(re.escape(s) for s in names)) if names else None
        self._prefixes = {s[:k] for s in names for k in range(1, len(s))}
        self._tail = ""

    def feed(self, s: str) -> list[Item]:
        s = self._tail + s
        self._tail = ""
        out: list[Item] = []
        pos = 0
        if self._re is not None:
            for m in self._re.finditer(s):
                _push_text(out, s[pos:m.start()])
                out.append(Special(m.group()))
                pos = m.end()
        rest = s[pos:]
        hold = max((k for k in range(1, min(len(rest), 64) + 1) if rest[-k:] in self._prefixes), default=0)
        _push_text(out, rest[:len(rest) - hold])
        self._tail = rest[len(rest) - hold:]
        return out

    def finish(self) -> list[Item]:
        out: list[Item] = []
        _push_text(out, self._tail)
        self._tail = ""
        return out


# Control tokens of the two families (token-level markup; see the encodings and parsers for where they go).
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"     # K2
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"             # K3
_ATTR = re.compile(r'\s+([A-Za-z_][\w-]*)="([^"]*)"')
_NAME = re.compile(r"[A-Za-z_][\w-]*")


def parse_tag(close: bool, header: str, raw: str) -> Tag | None:
    """A tag from the text between `<|open|>` / `<|close|>` and `<|sep|>`, or None if it is not one."""
    m = _NAME.match(header)
    if m is None:
        return None
    rest, attrs, pos = header[m.end():], {}, 0
    for a in _ATTR.finditer(rest):
        if a.start() != pos:
            return None
        attrs[a.group(1)] = a.group(2).replace("&quot;", '"').replace("&amp;", "&")   # the encoder's escapes
        pos = a.end()
    if rest[pos:].strip():
        return None
    return Tag(close, m.group(), attrs, raw)


class XtmlLexer:
    """Items -> items with K3 tags folded: `<|open|>` / `<|close|>`, header text, `<|sep|>` become one `Tag`.
    A header that another control token interrupts, or that does not parse, is given back as text."""

    def __init__(self):
        self._start: Special | None = None
        self._header = ""

    def feed(self, items: Iterable[Item]) -> list[Item]:
        out: list[Item] = []
        for it in items:
            if self._start is None:
                if isinstance(it, Special) and it.raw in (OPEN, CLOSE):
                    self._start, self._header = it, ""
                elif isinstance(it, str):
                    _push_text(out, it)
                else:
                    out.append(it)
                continue
            if isinstance(it, str):
                self._header += it
                continue
            if isinstance(it, Special) and it.raw == SEP:
                raw = self._start.raw + self._header + SEP
                tag = parse_tag(self._start.raw == CLOSE, self._header, raw)
                self._start = None
                if tag is None:
                    _push_text(out, raw)
                else:
                    out.append(tag)
                continue
            _push_text(out, self._start.raw + self._header)      # interrupted header: plain text
            self._start = None
            out.extend(self.feed([it]))
        return out

    def finish(self) -> list[Item]:
        out: list[Item] = []
        if self._start is not None:
            _push_text(out, self._start.raw + self._header)
            self._start = None
        return out
