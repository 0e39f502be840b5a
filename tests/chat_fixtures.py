"""Helpers of the chat tests.

`family_tokenizer`: the demo tokenizer of the Kimi K2 or K3 chat format (`write_demo_tokenizer`), the control
tokens at the offsets the real checkpoints use after the BPE ranks (K2: tool-call tokens at +11..+15, <think> /
</think> at +22 / +23; K3: <|end_of_msg|>, <|open|>, <|close|>, <|sep|> at +2..+5). `stream` / `collect`: feed a
parser in chunks and rebuild the message from its deltas the way an OpenAI client does. `TOOLS` / `ANSWER_SCHEMA`:
nested schemas whose strings, numbers and arrays are bounded, so a random model under the grammar terminates."""

from __future__ import annotations

from pathlib import Path

from kestrel.tokenizer import load_tokenizer, write_demo_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "opts": {"type": "object", "properties": {
                "units": {"enum": ["metric", "imperial"]},
                "hourly": {"type": "boolean"}},
                "required": ["units"], "additionalProperties": False}},
        "required": ["city", "opts"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {"q": {"type": "string", "minLength": 1, "maxLength": 10},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
                       "limit": {"type": ["integer", "null"], "minimum": 1, "maximum": 50}},
        "required": ["q"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object",
        "properties": {"slot": {"anyOf": [{"type": "object", "properties": {"day": {"enum": ["mon", "tue"]}},
                                           "required": ["day"], "additionalProperties": False},
                                          {"type": "integer", "minimum": 0, "maximum": 9}]}},
        "required": ["slot"], "additionalProperties": False}}},
]
ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 16},
    "score": {"type": "number", "minimum": 0, "maximum": 1},
    "items": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}},
                                         "required": ["k"], "additionalProperties": False}, "maxItems": 2}},
    "required": ["answer", "items"], "additionalProperties": False}

def family_tokenizer(directory: str | Path, family: str, vocab_size: int = 1024):
    d = Path(directory) / family
    write_demo_tokenizer(str(d), vocab_size, chat_format=family)
    return load_tokenizer(str(d))


def stream(parser: ChatOutputParser, chunks, by_ids: bool):
    deltas = []
    for c in chunks:
        deltas += parser.feed_ids(c) if by_ids else parser.feed_text(c)
    deltas += parser.finish()
    return deltas


def collect(deltas: list[dict]) -> dict:
    """Rebuild a message from OpenAI deltas the way a client does."""
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls, "the name / id of a call is sent once"
                calls[tc["index"]] = {"id": tc["id"], "type": tc["type"],
                                      "function": {"name": tc["function"]["name"], "arguments": ""}}
            calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    msg = {"role": "assistant", "content": content or None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg
