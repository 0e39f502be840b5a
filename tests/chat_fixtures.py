"""Helpers of the chat tests.

`family_tokenizer`: the demo tokenizer with the Kimi K2 or K3 control tokens named at the offsets the real
checkpoints use after the BPE ranks (K2: tool-call tokens at +11..+15, <think> / </think> at +22 / +23; K3:
<|end_of_msg|>, <|open|>, <|close|>, <|sep|> at +2..+5). `stream` / `collect`: feed a parser in chunks and rebuild
the message from its deltas the way an OpenAI client does."""

from __future__ import annotations

import json
from pathlib import Path

from kestrel.tokenizer import NUM_RESERVED_SPECIAL_TOKENS, load_tokenizer, write_demo_tokenizer

K2_SPECIALS = {11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
               14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 22: "<think>", 23: "</think>"}
K3_SPECIALS = {2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>"}


def family_tokenizer(directory: str | Path, family: str, vocab_size: int = 1024):
    d = Path(directory) / family
    write_demo_tokenizer(str(d), vocab_size)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    base = vocab_size - NUM_RESERVED_SPECIAL_TOKENS
    for offset, name in (K2_SPECIALS if family == "kimi_k2" else K3_SPECIALS).items():
        cfg["added_tokens_decoder"][str(base + offset)]["content"] = name
    if family == "kimi_k3":
        cfg.pop("chat_template")            # K3's encoding is code; its turns end with <|end_of_msg|>
        cfg["eos_token"] = "<|end_of_msg|>"
    cfg_path.write_text(json.dumps(cfg))
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
