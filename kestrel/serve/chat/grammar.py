"""Constrained decoding for tool calls and structured output, with llguidance.

Per request, `GrammarCompiler.for_request` builds a Lark grammar in the model family's own markup and compiles it
into a `RequestGrammar` (an llguidance matcher), or returns None when nothing is constrained (tool_choice auto /
none, response_format text): such requests pay nothing. Each decode step, `fill_bitmasks` writes one int32 row
[ceil(V/32)] per request (bit 1 = allowed; rows without a grammar all ones) into a host tensor, the sampler copies
it to the device and applies it with `apply_bitmask_`, and after sampling each matcher `accept`s its token.

What the grammars force (special tokens by id, so the model can only write markup as the control tokens, never as
their spelling in text):

- `tool_choice` "required": one or more calls (one when `parallel_tool_calls` is false), each to a declared tool
  with arguments valid against its `parameters`; a named function: exactly one call to it.
  kimi_k2: `<|tool_calls_section_begin|>` (`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>`
  JSON `<|tool_call_end|>`)+ `<|tool_calls_section_end|>`, IDX counting on from the conversation's calls.
  kimi_k3: the response channel closed empty, then `tools` > `call tool="NAME" index="k"` > one `argument` per
  property (required ones always, in schema order; strings raw, other types JSON), or one `json` element when the
  schema is not a plain object of simple properties; then the message closes.
- `response_format` json_object / json_schema: the content is JSON (valid against the schema).
- Thinking, where the prompt opened it (or K2's optional `<think>` block), stays free text before the constrained
  part. Whitespace in JSON is fixed (", " and ": ", the separators the chat encodings write), so a grammar never
  lets the model loop on blanks.

Ids past the tokenizer's size (the model's vocabulary can be larger) are never allowed. llguidance was chosen over
xgrammar after measuring both on the CPU (`benchmarks/results/grammar_cpu.md`) and because its grammars name
special tokens apart from text.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

from kestrel.serve.chat.markup import (ARGS_BEGIN, CALL_BEGIN, CALL_END, CLOSE, OPEN, SECTION_BEGIN, SECTION_END, SEP,
                                       THINK_CLOSE, THINK_OPEN)
from kestrel.serve.chat.prompt import ChatPrompt
from kestrel.serve.chat.request import FieldError, Tool, ToolRequest

MAX_PARALLEL_CALLS = 8
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lock = threading.Lock()
_lltokenizers: dict = {}


def lltokenizer_for(tokenizer, vocab_size: int, stop_ids=None):
    """The llguidance view of a tokenizer (built once per tokenizer and size: ~1 s at 163,840 ids).

    Pieces come from `Tokenizer.id_to_piece`; ids from the tokenizer's size up to `vocab_size` get empty pieces,
    which llguidance never allows. `stop_ids` (default: the tokenizer's end-of-turn ids) are what a finished
    grammar allows next."""
    import llguidance as llg

    stops = tuple(sorted(stop_ids if stop_ids is not None else tokenizer.eos_token_ids))
    key = (id(tokenizer), vocab_size, stops)
    with _lock:
        cached = _lltokenizers.get(key)
        if cached is not None and cached[0] is tokenizer:
            return cached[1]
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {tokenizer.vocab_size} ids")

    class _Wrapper:
        eos_token_id = stops[0] if stops else None
        bos_token_id = tokenizer.bos_token_id
        tokens = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
        tokens += [b""] * (vocab_size - tokenizer.vocab_size)
        special_token_ids = sorted(tokenizer.special_ids)

        def __call__(self, s):
            return tokenizer.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

    llt = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapper()), eos_token=list(stops) or None)
    with _lock:
        _lltokenizers[key] = (tokenizer, llt)
    return llt


class RequestGrammar:
    """One request's matcher: fill its mask row, accept the sampled token."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed-token bits into `row` (a contiguous host int32 tensor of ceil(V/32) words)."""
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous():
            raise ValueError("the bitmask row must be a contiguous int32 CPU tensor")
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance with the sampled token; False if the grammar did not allow it (a sampler that skipped the mask)."""
        return self.matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """Nothing but a stop token can follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask [batch, ceil(V/32)] int32, all tokens allowed (pinned when a GPU is there)."""
    t = torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    return t.pin_memory() if torch.cuda.is_available() else t


def fill_bitmasks(grammars: list[RequestGrammar | None], bitmask: torch.Tensor) -> bool:
    """Fill row b from grammars[b] (rows without a grammar: all allowed). Returns whether any row is constrained,
    so a batch without grammars can skip applying the mask."""
    any_grammar = False
    for b, g in enumerate(grammars):
        if g is None:
            bitmask[b].fill_(-1)
        else:
            g.fill(bitmask[b])
            any_grammar = True
    return any_grammar


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits[b, v] = -inf where bit v of row b is 0 (in place; logits [B, V], bitmask [B, ceil(V/32)] int32 on
    the logits' device). Plain torch: the reference a fused sampler kernel compares against."""
    bits = _BITS.get(bitmask.device)
    if bits is None:
        bits = _BITS[bitmask.device] = torch.ones(32, dtype=torch.int32, device=bitmask.device) << torch.arange(
            32, dtype=torch.int32, device=bitmask.device)
    banned = ((bitmask.unsqueeze(-1) & bits) == 0).flatten(1)[:, :logits.shape[-1]]
    return logits.masked_fill_(banned, float("-inf"))


_BITS: dict = {}


# ---- grammar text --------------------------------------------------------------------------------------------

def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _json_rule(schema) -> str:
    schema = dict(schema) if isinstance(schema, dict) else {} if schema is True else {"not": {}}
    schema["x-guidance"] = dict(JSON_OPTIONS)
    return "%json " + json.dumps(schema, ensure_ascii=False)


_SIMPLE_STRING_KEYS = {"type", "enum", "const", "minLength", "maxLength", "description", "title", "default",
                       "examples"}
_TOP_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema",
             "strict"}


def _types(prop: dict) -> list[str] | None:
    """The JSON types a property may take, or None if that is not plain to see (anyOf, $ref, ...)."""
    if any(k in prop for k in ("anyOf", "oneOf", "allOf", "$ref", "not", "if")):
        return None
    if "const" in prop or "enum" in prop:
        values = [prop["const"]] if "const" in prop else prop["enum"]
        if not isinstance(values, list) or not values:
            return None
        names = []
        for v in values:
            t = ("boolean" if isinstance(v, bool) else "null" if v is None else "number"
                 if isinstance(v, (int, float)) else "string" if isinstance(v, str) else "object"
                 if isinstance(v, dict) else "array")
            if t not in names:
                names.append(t)
        return names
    t = prop.get("type")
    if isinstance(t, str):
        t = [t]
    if not isinstance(t, list) or not t:
        return None
    return list(dict.fromkeys("number" if x == "integer" else x for x in t))


def _xtml_value(prop: dict, t: str) -> str | None:
    """The grammar of a K3 argument value of XTML type `t`, or None when it cannot be written plainly."""
    if t == "string":
        if set(prop) - _SIMPLE_STRING_KEYS:
            return None
        values = [prop["const"]] if "const" in prop else prop.get("enum")
        if values is not None:
            return "(" + " | ".join(_lit(v) for v in values if isinstance(v, str)) + ")"
        lo, hi = prop.get("minLength", 0), prop.get("maxLength")
        if lo == 0 and hi is None:
            return "/(?s:.*)/"
        return "/(?s:.{%d,%s})/" % (lo, "" if hi is None else hi)
    sub = dict(prop)
    if "enum" in sub or "const" in sub:
        values = [sub.pop("const")] if "const" in sub else sub.pop("enum")
        sub["enum"] = [v for v in values if not isinstance(v, str)]
    elif isinstance(sub.get("type"), list):
        sub["type"] = [x for x in sub["type"] if ("number" if x == "integer" else x) == t]
    return _json_rule(sub)


@dataclass
class _Lark:
    tok: object
    rules: list

    def sp(self, name: str, param: str) -> str:
        i = self.tok.token_to_id(name)
        if i is None or not self.tok.is_special(i):
            raise FieldError(param, f"cannot be enforced: this model's tokenizer has no {name} control token "
                                    "(the chat format's markup)")
        return f"<[{i}]>"

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def text(self) -> str:
        return "\n".join(self.rules) + "\n"


def build_lark(family: str, tokenizer, req: ToolRequest, prompt: ChatPrompt,
               model_opens_thinking: bool = False) -> tuple[str, str] | None:
    """(Lark grammar, the request field it enforces), or None when the request constrains nothing.

    `model_opens_thinking` (K2 Thinking): the model may start with its own `<think>..</think>` block; instruct
    models get no such block (a free-text block a model could wander into before the call)."""
    choice, rf = req.tool_choice, req.response_format
    if choice.mode in ("required", "function"):
        param = "tool_choice"
        tools = [req.tool(choice.name)] if choice.mode == "function" else list(req.tools)
        max_calls = 1 if choice.mode == "function" or not req.parallel_tool_calls else MAX_PARALLEL_CALLS
    elif rf.type in ("json_object", "json_schema"):
        param, tools, max_calls = "response_format", [], 0
    else:
        return None
    g = _Lark(tokenizer, [])
    body = (_k2_calls if family == "kimi_k2" else _k3_calls)(g, tools, max_calls, prompt, param) if tools \
        else g.rule("answer", _json_rule(rf.schema if rf.type == "json_schema" else {"type": "object"}))
    if family == "kimi_k2":
        think = ""
        if prompt.opens_reasoning:
            think = f"THINK? {g.sp(THINK_CLOSE, param)} "
        elif model_opens_thinking:
            think = f"({g.sp(THINK_OPEN, param)} THINK? {g.sp(THINK_CLOSE, param)})? "
        g.rule("start", think + body)
    else:
        o, c, s = g.sp(OPEN, param), g.sp(CLOSE, param), g.sp(SEP, param)
        think = f'THINK? {c} "think" {s} {o} "response" {s} ' if prompt.opens_reasoning else ""
        if tools:
            g.rule("start", f'{think}{c} "response" {s} {o} "tools" {s} {body} {c} "tools" {s} {c} "message" {s}')
        else:
            g.rule("start", f'{think}{body} {c} "response" {s} {c} "message" {s}')
    g.rules.append("THINK: /(?s:.+)/")
    return g.text(), param


def _chain(g: _Lark, call_rule, max_calls: int) -> str:
    """calls: call_0 (call_1 (call_2 ...)?)?  -- each position its own rule, so it can carry its own index."""
    tail = ""
    for k in reversed(range(max_calls)):
        tail = g.rule(f"calls_{k}", call_rule(k) + (f" {tail}?" if tail else ""))
    return tail


def _k2_calls(g: _Lark, tools: list[Tool], max_calls: int, prompt: ChatPrompt, param: str) -> str:
    args = [g.rule(f"args_{i}", _json_rule(t.parameters)) for i, t in enumerate(tools)]
    cb, ab, ce = g.sp(CALL_BEGIN, param), g.sp(ARGS_BEGIN, param), g.sp(CALL_END, param)

    def call(k: int) -> str:
        idx = prompt.next_call_index + k
        alts = " | ".join(f"{_lit(f'functions.{t.name}:{idx}')} {ab} {a}" for t, a in zip(tools, args))
        return f"{cb} ({alts}) {ce}"

    return f"{g.sp(SECTION_BEGIN, param)} {_chain(g, call, max_calls)} {g.sp(SECTION_END, param)}"


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace('"', "&quot;")


def _k3_arguments(g: _Lark, i: int, tool: Tool, o: str, c: str, s: str) -> str:
    """The grammar of one K3 call's body: an argument element per property, or one json element."""
    params = tool.parameters
    props = params.get("properties") or {}
    if not set(params) - _TOP_KEYS and isinstance(props, dict):
        parts = []
        for j, (key, prop) in enumerate(props.items()):
            types = _types(prop) if isinstance(prop, dict) else None
            values = [(t, _xtml_value(prop, t)) for t in types] if types else None
            if not values or any(v is None for _, v in values):
                break
            head = lambda t: _lit(f'argument key="{_esc(key)}" type="{t}"')
            alts = " | ".join(f"{o} {head(t)} {s} {v} {c} \"argument\" {s}" for t, v in values)
            name = g.rule(f"arg_{i}_{j}", alts)
            parts.append(name if key in (params.get("required") or []) else f"{name}?")
        else:
            return " ".join(parts)
    return f'{o} "json type=\\"object\\"" {s} {g.rule(f"args_{i}", _json_rule(params))} {c} "json" {s}'


def _k3_calls(g: _Lark, tools: list[Tool], max_calls: int, prompt: ChatPrompt, param: str) -> str:
    o, c, s = g.sp(OPEN, param), g.sp(CLOSE, param), g.sp(SEP, param)
    bodies = [g.rule(f"body_{i}", _k3_arguments(g, i, t, o, c, s) or '""') for i, t in enumerate(tools)]

    def call(k: int) -> str:
        alts = " | ".join(f"{_lit(f'call tool={chr(34)}{_esc(t.name)}{chr(34)} index={chr(34)}{k + 1}{chr(34)}')} "
                          f"{s} {b}" for t, b in zip(tools, bodies))
        return f"{o} ({alts}) {c} \"call\" {s}"

    return _chain(g, call, max_calls)


# ---- compiling -----------------------------------------------------------------------------------------------

class GrammarCompiler:
    """Per server: the tokenizer's llguidance view; per request: `for_request` -> RequestGrammar | None."""

    def __init__(self, tokenizer, vocab_size: int, family: str, stop_ids=None, model_opens_thinking: bool = False):
        self.tokenizer, self.vocab_size, self.family = tokenizer, vocab_size, family
        self.model_opens_thinking = model_opens_thinking
        self.lltok = lltokenizer_for(tokenizer, vocab_size, stop_ids)

    def check_schema(self, schema, param: str) -> None:
        """A JSON schema llguidance cannot compile is the client's error: FieldError naming `param`."""
        import llguidance as llg

        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except ValueError as e:
            raise FieldError(param, f"is not a usable JSON schema ({e})") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if is_error:
            raise FieldError(param, f"cannot be compiled to a grammar: {_first_line(messages)}")

    def check_request(self, req: ToolRequest) -> None:
        for i, t in enumerate(req.tools):
            self.check_schema(t.parameters, f"tools[{i}].function.parameters")
        if req.response_format.type == "json_schema":
            self.check_schema(req.response_format.schema, "response_format.json_schema.schema")

    def for_request(self, req: ToolRequest, prompt: ChatPrompt) -> RequestGrammar | None:
        built = build_lark(self.family, self.tokenizer, req, prompt, self.model_opens_thinking)
        if built is None:
            return None
        self.check_request(req)
        return self.compile(*built)

    def compile(self, lark: str, param: str) -> RequestGrammar:
        import llguidance as llg

        grammar = llg.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if is_error:
            raise FieldError(param, f"cannot be compiled to a grammar: {_first_line(messages)}")
        m = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise FieldError(param, f"cannot be compiled to a grammar: {_first_line([m.get_error()])}")
        return RequestGrammar(m, self.vocab_size)


def _first_line(messages: list[str]) -> str:
    """The first line of llguidance's first message (what a 400 can say in one line)."""
    lines = (messages[0] if messages else "").splitlines()
    return lines[0] if lines else "the grammar library gave no reason"
