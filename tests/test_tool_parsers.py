"""Tool-call and reasoning parsers on outputs written from the K2 and K3 formats: whole, streamed token by token,
split at every chunk boundary (ids and text), malformed and truncated, several calls, calls after thinking."""

from __future__ import annotations

import json

import pytest

from chat_fixtures import collect, family_tokenizer, stream
from kestrel.serve.chat.output import ChatOutputParser, parse_ids, parse_text
from kestrel.serve.chat.tool_parsers import sequential_ids

K2_CALLS = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.search:1'
            '<|tool_call_argument_begin|>{"q": "a \\"b\\" c"}<|tool_call_end|>'
            '<|tool_calls_section_end|>')
K2_EXPECTED = [
    {"id": "functions.get_weather:0", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
    {"id": "functions.search:1", "type": "function",
     "function": {"name": "search", "arguments": '{"q": "a \\"b\\" c"}'}},
]

K3_CALLS = ('<|close|>response<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|>Say "hi"\n<|close|>argument<|sep|>'
            '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
            '<|open|>argument key="opts" type="object"<|sep|>{"units": "metric"}<|close|>argument<|sep|>'
            '<|close|>call<|sep|>'
            '<|open|>call tool="a&amp;b" index="2"<|sep|><|close|>call<|sep|>'
            '<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
K3_EXPECTED = [
    {"id": "call_0", "type": "function",
     "function": {"name": "get_weather",
                  "arguments": '{"city": "Say \\"hi\\"\\n", "days": 2, "opts": {"units": "metric"}}'}},
    {"id": "call_1", "type": "function", "function": {"name": "a&b", "arguments": "{}"}},
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_tok")
    return {f: family_tokenizer(d, f) for f in ("kimi_k2", "kimi_k3")}


def ids_of(tok, s: str) -> list[int]:
    """Markup spellings become control tokens (as a model samples them); text in between is plain text."""
    return tok.encode(s, allow_special=True)


def check_all_splits(tok, family, text, expected_msg, **kw):
    """Non-streaming, token by token, every 2-chunk split of the ids and of the text: all give expected_msg."""
    ids = ids_of(tok, text)
    whole = parse_ids(family, tok, ids, id_factory=sequential_ids(), **kw).message()
    assert whole == expected_msg
    one = ChatOutputParser(family, tok, id_factory=sequential_ids(), **kw)
    assert collect(stream(one, [[i] for i in ids], by_ids=True)) == expected_msg
    for cut in range(len(ids) + 1):
        p = ChatOutputParser(family, tok, id_factory=sequential_ids(), **kw)
        assert collect(stream(p, [ids[:cut], ids[cut:]], by_ids=True)) == expected_msg, cut
    assert parse_text(family, text, id_factory=sequential_ids(), **kw).message() == expected_msg
    for cut in range(len(text) + 1):
        p = ChatOutputParser(family, id_factory=sequential_ids(), **kw)
        assert collect(stream(p, [text[:cut], text[cut:]], by_ids=False)) == expected_msg, cut


def test_k2_content_then_two_calls(toks):
    expected = {"role": "assistant", "content": "Let me look.", "tool_calls": K2_EXPECTED}
    check_all_splits(toks["kimi_k2"], "kimi_k2", "Let me look." + K2_CALLS + "<|im_end|>", expected, reasoning=False)


def test_k2_calls_after_thinking_and_without_think_end(toks):
    tok = toks["kimi_k2"]
    expected = {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
                "tool_calls": K2_EXPECTED}
    check_all_splits(tok, "kimi_k2", "<think>Need the weather.</think>" + K2_CALLS, expected)
    # the prompt opened <think>; the model never closes it and goes straight to its calls: nothing is lost
    check_all_splits(tok, "kimi_k2", "Need the weather." + K2_CALLS, expected, starts_in_reasoning=True)
    # thinking that never ends is reasoning, not dropped
    msg = parse_ids("kimi_k2", tok, ids_of(tok, "still thinking"), starts_in_reasoning=True).message()
    assert msg == {"role": "assistant", "content": None, "reasoning_content": "still thinking"}


def test_k2_malformed_and_truncated_are_text(toks):
    tok = toks["kimi_k2"]
    bad_header = "Hi<|tool_calls_section_begin|><|tool_call_begin|>  <|tool_call_argument_begin|>{}<|tool_call_end|>"
    msg = parse_ids("kimi_k2", tok, ids_of(tok, bad_header)).message()
    assert msg == {"role": "assistant",
                   "content": "Hi<|tool_call_begin|>  <|tool_call_argument_begin|>{}<|tool_call_end|>"}
    cut_header = "Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.get_wea"
    check_all_splits(tok, "kimi_k2", cut_header,
                     {"role": "assistant", "content": "Hi<|tool_call_begin|>functions.get_wea"}, reasoning=False)
    cut_args = '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>{"a": "x'
    p = parse_ids("kimi_k2", tok, ids_of(tok, cut_args), id_factory=sequential_ids())
    assert p.message()["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": "x'}
    assert p.finish_reason("length") == "length" and p.finish_reason("stop") == "tool_calls"
    # a missing <|tool_call_end|>: the next call still parses
    two = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}'
           '<|tool_call_begin|>b<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|><|tool_calls_section_end|>')
    calls = parse_ids("kimi_k2", tok, ids_of(tok, two)).message()["tool_calls"]
    assert [(c["id"], c["function"]["arguments"]) for c in calls] == [("functions.a:0", "{}"),
                                                                       ("functions.b:1", '{"x": 1}')]


def test_k2_markup_spelled_in_text_is_not_markup(toks):
    tok = toks["kimi_k2"]
    spelled = tok.encode("see <|tool_calls_section_begin|> here", allow_special=False)
    assert parse_ids("kimi_k2", tok, spelled).message() == {
        "role": "assistant", "content": "see <|tool_calls_section_begin|> here"}


def test_k2_tools_disabled_returns_markup_as_text(toks):
    tok = toks["kimi_k2"]
    msg = parse_ids("kimi_k2", tok, ids_of(tok, "x" + K2_CALLS), tools=False).message()
    assert msg == {"role": "assistant", "content": "x" + K2_CALLS}


def test_k3_thinking_response_and_calls(toks):
    tok = toks["kimi_k3"]
    out = "Plan: call it.<|close|>think<|sep|><|open|>response<|sep|>On it." + K3_CALLS
    expected = {"role": "assistant", "content": "On it.", "reasoning_content": "Plan: call it.",
                "tool_calls": K3_EXPECTED}
    check_all_splits(tok, "kimi_k3", out, expected, starts_in_reasoning=True)
    # thinking opened by the model itself, after a non-thinking prefix
    out2 = "<|open|>think<|sep|>Plan: call it.<|close|>think<|sep|><|open|>response<|sep|>On it." + K3_CALLS
    assert parse_ids("kimi_k3", tok, ids_of(tok, out2), id_factory=sequential_ids()).message() == expected


def test_k3_missing_think_end_keeps_calls_and_text(toks):
    tok = toks["kimi_k3"]
    out = "Plan.<|open|>response<|sep|>Answer" + K3_CALLS
    expected = {"role": "assistant", "content": "Answer", "reasoning_content": "Plan.", "tool_calls": K3_EXPECTED}
    check_all_splits(tok, "kimi_k3", out, expected, starts_in_reasoning=True)
    out = "Plan.<|open|>tools<|sep|>" + K3_CALLS.split("<|open|>tools<|sep|>", 1)[1]
    msg = parse_ids("kimi_k3", tok, ids_of(tok, out), starts_in_reasoning=True, id_factory=sequential_ids()).message()
    assert msg["tool_calls"] == K3_EXPECTED and msg["reasoning_content"] == "Plan."


def test_k3_non_thinking_plain_answer(toks):
    tok = toks["kimi_k3"]
    out = "Hello <there> & \"you\"<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    check_all_splits(tok, "kimi_k3", out, {"role": "assistant", "content": 'Hello <there> & "you"'})


def test_k3_typed_values_and_json_block(toks):
    tok = toks["kimi_k3"]
    out = ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
           '<|open|>argument key="n" type="number"<|sep|>not json<|close|>argument<|sep|>'
           '<|open|>argument key="b" type="boolean"<|sep|> true <|close|>argument<|sep|><|close|>call<|sep|>'
           '<|open|>call tool="g" index="2"<|sep|><|open|>json type="object"<|sep|>{"raw": [1, 2]}'
           '<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    calls = parse_ids("kimi_k3", tok, ids_of(tok, out), id_factory=sequential_ids()).message()["tool_calls"]
    args = [c["function"]["arguments"] for c in calls]
    assert args == ['{"n": "not json", "b": true}', '{"raw": [1, 2]}']
    assert json.loads(args[0]) == {"n": "not json", "b": True}


def test_k3_malformed_and_truncated(toks):
    tok = toks["kimi_k3"]
    no_name = '<|open|>tools<|sep|><|open|>call index="1"<|sep|>x<|close|>call<|sep|><|close|>tools<|sep|>'
    assert parse_ids("kimi_k3", tok, ids_of(tok, no_name)).message() == {
        "role": "assistant", "content": '<|open|>call index="1"<|sep|>x<|close|>call<|sep|>'}
    cut_tag = 'Hi<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_w'
    check_all_splits(tok, "kimi_k3", cut_tag, {"role": "assistant", "content": 'Hi<|open|>call tool="get_w'})
    cut_arg = ('<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
               '<|open|>argument key="cmd" type="string"<|sep|>rm -r')
    p = parse_ids("kimi_k3", tok, ids_of(tok, cut_arg), id_factory=sequential_ids())
    assert p.message()["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"cmd": "rm -r'}
    assert p.finish_reason("length") == "length"
    # a header interrupted by another control token is text
    odd = "a<|open|>resp<|close|>response<|sep|>"
    assert parse_ids("kimi_k3", tok, ids_of(tok, odd)).message() == {"role": "assistant", "content": "a<|open|>resp"}


def test_k3_close_marker_spelled_in_a_string_argument(toks):
    tok = toks["kimi_k3"]
    head = ids_of(tok, '<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                       '<|open|>argument key="s" type="string"<|sep|>')
    body = tok.encode("<|close|>argument<|sep|>", allow_special=False)
    tail = ids_of(tok, "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>")
    calls = parse_ids("kimi_k3", tok, head + body + tail).message()["tool_calls"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"s": "<|close|>argument<|sep|>"}


def test_k3_tools_disabled_echoes_the_channel(toks):
    tok = toks["kimi_k3"]
    out = "Sure.<|close|>response<|sep|><|open|>tools<|sep|>x<|close|>tools<|sep|><|close|>message<|sep|>"
    assert parse_ids("kimi_k3", tok, ids_of(tok, out), tools=False).message() == {
        "role": "assistant", "content": "Sure.<|open|>tools<|sep|>x<|close|>tools<|sep|>"}


def test_ids_past_the_tokenizer_and_split_characters(toks):
    tok = toks["kimi_k2"]
    ids = tok.encode("café ✓")
    p = ChatOutputParser("kimi_k2", tok, reasoning=False)
    deltas = []
    for i in ids + [tok.vocab_size + 5]:
        deltas += p.feed_ids([i])
    deltas += p.finish()
    assert all("\ufffd" not in d.get("content", "") for d in deltas)
    assert p.message()["content"] == "café ✓"


def test_unknown_family():
    with pytest.raises(ValueError, match="unknown chat family"):
        ChatOutputParser("llama")
