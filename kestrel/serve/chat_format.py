"""The server's chat format: how a chat request becomes prompt ids, its grammar and its output parser.

One `ChatFormat` per server, from `--chat-format`, `--tool-call-parser` and `--reasoning-parser`:

- `kimi_k2` (Kimi K2 / Kimi Linear) and `kimi_k3` encode messages with the family's encoding as code
  (`kestrel.serve.chat.k2_encoding` / `k3_encoding`): markup segments as control tokens, request text as plain text.
  `template` renders the checkpoint's Jinja template through `Tokenizer.encode_chat` (request strings never become
  control tokens there either; tools are passed to it as `tools`). `auto` is `template` when the checkpoint ships
  a Jinja template (its own truth: Kimi Linear, K2), else the family whose control tokens the tokenizer has (K3:
  its encoding is code).
- The parsers default to the family of the tokenizer's control tokens (K3's XTML tokens, or K2's tool-call
  tokens; none when it has neither); `--tool-call-parser` / `--reasoning-parser` name them explicitly (vLLM's flag
  names). With the Jinja template and parsers found only from the tokenizer, just the turns that offer tools are
  parsed (a plain chat stays the engine's text). An explicit reasoning parser also turns on K2's thinking prompt
  (`<think>` opened by the generation prompt; `reasoning_effort: "none"` closes it at once); without it K2 prompts
  have the instruct form (Kimi Linear Instruct). K3 thinks unless `reasoning_effort` is "none".
- `tool_choice` required / a named function and `response_format` json_object / json_schema get an llguidance
  grammar (`kestrel.serve.chat.grammar`) that the engine applies as a token bitmask; other requests get none and
  pay nothing. Every error a request can cause here is a `FieldError` / `KestrelError` naming its field.
"""

from __future__ import annotations

import logging

from kestrel.errors import KestrelError
from kestrel.serve.chat.grammar import GrammarCompiler, RequestGrammar
from kestrel.serve.chat.k2_encoding import encode_k2
from kestrel.serve.chat.k3_encoding import encode_k3
from kestrel.serve.chat.markup import (ARGS_BEGIN, CALL_BEGIN, CALL_END, CLOSE, END_OF_MSG, OPEN, SECTION_BEGIN,
                                       SECTION_END, SEP, THINK_OPEN)
from kestrel.serve.chat.output import FAMILIES, ChatOutputParser
from kestrel.serve.chat.prompt import ChatPrompt
from kestrel.serve.chat.request import FieldError, ToolRequest

log = logging.getLogger("kestrel.serve")

CHAT_FORMATS = ("auto", "kimi_k2", "kimi_k3", "template")
PARSERS = FAMILIES
_CONTROL = {"kimi_k2": (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END),
            "kimi_k3": (OPEN, CLOSE, SEP, END_OF_MSG)}


def has_controls(tokenizer, family: str) -> bool:
    def special(name):
        i = tokenizer.token_to_id(name)
        return i is not None and tokenizer.is_special(i)
    return all(special(n) for n in _CONTROL[family])


def detect_family(tokenizer) -> str | None:
    """The family whose control tokens the tokenizer has."""
    return next((f for f in ("kimi_k3", "kimi_k2") if has_controls(tokenizer, f)), None)


class ChatFormat:
    def __init__(self, tokenizer, vocab_size: int, stop_ids, chat_format: str = "auto",
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        if chat_format not in CHAT_FORMATS:
            raise KestrelError(f"--chat-format {chat_format}: not one of {', '.join(CHAT_FORMATS)}")
        for flag, value in (("--tool-call-parser", tool_call_parser), ("--reasoning-parser", reasoning_parser)):
            if value is not None and value not in PARSERS:
                raise KestrelError(f"{flag} {value}: not one of {', '.join(PARSERS)}")
        self.tokenizer = tokenizer
        found = detect_family(tokenizer)
        if chat_format == "auto":
            chat_format = "template" if tokenizer.has_chat_template or found is None else found
        self.format = chat_format
        default = chat_format if chat_format in FAMILIES else found
        self.tool_parser = tool_call_parser or default
        self.reasoning_parser = reasoning_parser or default
        self.thinking = reasoning_parser is not None      # K2: the thinking prompt form
        self.explicit_parsers = tool_call_parser is not None or reasoning_parser is not None
        if self.tool_parser and self.reasoning_parser and self.tool_parser != self.reasoning_parser:
            raise KestrelError(f"--tool-call-parser {self.tool_parser} and --reasoning-parser "
                               f"{self.reasoning_parser} are different families; give both the same one")
        self.family = self.format if self.format in FAMILIES else (self.tool_parser or self.reasoning_parser)
        for what, family in (("--chat-format", self.format if self.format in FAMILIES else None),
                             ("--tool-call-parser", self.tool_parser)):
            if family is not None and not has_controls(tokenizer, family):
                raise KestrelError(f"{what} {family}: this checkpoint's tokenizer lacks the {family} control tokens "
                                   f"({', '.join(_CONTROL[family])}); pick the model's own format")
        if self.format == "template" and not tokenizer.has_chat_template:
            self.format = None                  # no chat at all: /v1/chat/completions answers 400
        self.vocab_size, self.stop_ids = vocab_size, sorted(stop_ids)
        self._compiler: GrammarCompiler | None = None
        if self.family is not None:     # built now, not in the first tool request (~1 s at Kimi's vocabulary)
            _ = self.compiler

    def describe(self) -> str:
        return (f"chat format {self.format or 'none'}, tool-call parser {self.tool_parser or 'none'}, reasoning "
                f"parser {self.reasoning_parser or 'none'}")

    @property
    def compiler(self) -> GrammarCompiler:
        """The tokenizer's grammar view, built at the first constrained request (about 1 s at Kimi's vocabulary)."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.family or "kimi_k2",
                                             stop_ids=self.stop_ids)
        return self._compiler

    # ---- one request ---------------------------------------------------------------------------------------
    def encode(self, req) -> tuple[list[int], ChatPrompt]:
        """Prompt ids of a chat request (`protocol.ChatRequest`) and its prompt facts. Raises KestrelError (a
        FieldError names its field)."""
        if self.format is None:
            raise FieldError("messages", "cannot be used: this checkpoint has no chat template; use "
                                         "/v1/completions")
        treq: ToolRequest = req.tools
        decls = [t.declaration for t in treq.tools]
        if decls and treq.tool_choice.mode != "none" and self.tool_parser is None:
            raise FieldError("tools", "cannot be used: this server's chat format has no tool-call parser; start it "
                                      "with --tool-call-parser kimi_k2|kimi_k3 (or --chat-format)")
        if self.format == "kimi_k2":
            thinking = None if not self.thinking else treq.reasoning_effort != "none"
            prompt = encode_k2(req.messages, decls, add_generation_prompt=req.add_generation_prompt,
                               thinking=thinking)
        elif self.format == "kimi_k3":
            prompt = encode_k3(req.messages, decls, add_generation_prompt=req.add_generation_prompt,
                               reasoning_effort=treq.reasoning_effort, tool_choice=treq.tool_choice.mode,
                               response_format=req.response_format)
        else:
            kwargs = dict(req.chat_template_kwargs)
            if decls:
                kwargs["tools"] = decls
            ids = self.tokenizer.encode_chat(req.messages, req.add_generation_prompt, **kwargs)
            return ids, self._template_facts(req, decls, ids)
        return prompt.token_ids(self.tokenizer), prompt

    def _template_facts(self, req, decls: list, ids: list[int]) -> ChatPrompt:
        """What the grammar and the parsers need to know of a prompt the Jinja template wrote: whether it ends
        inside `<think>`, and (K2) the index the next tool call gets (K2 numbers calls over the conversation;
        counted as K2's encoding counts them)."""
        facts = ChatPrompt(self.family or "kimi_k2")
        if facts.family == "kimi_k2":
            facts.next_call_index = encode_k2(req.messages, decls, add_generation_prompt=False).next_call_index
            think = self.tokenizer.token_to_id(THINK_OPEN)
            facts.opens_reasoning = bool(ids) and think is not None and ids[-1] == think
        return facts

    def check(self, treq: ToolRequest) -> None:
        """Tool schemas the grammar library cannot compile are the client's error even when nothing forces a
        call (tool_choice auto), so the request fails now rather than at a later forced turn."""
        if treq.tools or treq.response_format.type == "json_schema":
            self.compiler.check_request(treq)

    def grammar(self, treq: ToolRequest, prompt: ChatPrompt) -> RequestGrammar | None:
        """A fresh matcher for one choice, or None when nothing is constrained."""
        if treq.tool_choice.mode in ("required", "function") or treq.response_format.type != "text":
            return self.compiler.for_request(treq, prompt)
        return None

    def parser(self, treq: ToolRequest, prompt: ChatPrompt) -> ChatOutputParser | None:
        """One choice's output parser, or None: the output is the engine's text. The Jinja template with parsers
        only found from the tokenizer parses the turns that offer tools; plain chats stay the engine's text
        (exactly `LLM.chat`'s, stop strings cut where the engine cut them)."""
        tools = self.tool_parser is not None and bool(treq.tools) and treq.tool_choice.mode != "none"
        if self.tool_parser is None and self.reasoning_parser is None:
            return None
        if self.format == "template" and not self.explicit_parsers and not tools:
            return None
        return ChatOutputParser(self.family, self.tokenizer, reasoning=self.reasoning_parser is not None,
                                tools=tools, starts_in_reasoning=prompt.opens_reasoning)
