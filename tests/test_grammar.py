"""Constrained decoding: a random "model" (random logits, masked by the request's bitmask, sampled) always writes a
tool call whose arguments validate against the tool's schema, or JSON valid against the response schema; bitmask
helpers against a per-token reference; request errors name their field."""

from __future__ import annotations

import json

import pytest
import torch

from chat_fixtures import ANSWER_SCHEMA, TOOLS, collect, family_tokenizer, stream
from kestrel.serve.chat.grammar import (GrammarCompiler, allocate_bitmask, apply_bitmask_, bitmask_words,
                                        build_lark, fill_bitmasks)
from kestrel.serve.chat.k2_encoding import encode_k2
from kestrel.serve.chat.k3_encoding import encode_k3
from kestrel.serve.chat.output import ChatOutputParser, parse_ids
from kestrel.serve.chat.request import FieldError, parse_tool_request
from kestrel.serve.chat.tool_parsers import sequential_ids

jsonschema = pytest.importorskip("jsonschema")

V = 1056        # the model's vocabulary: 32 ids more than the tokenizer has, never to be sampled
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = tmp_path_factory.mktemp("grammar_tok")
    return {f: family_tokenizer(d, f) for f in ("kimi_k2", "kimi_k3")}


@pytest.fixture(scope="module")
def compilers(toks):
    return {f: GrammarCompiler(t, V, f) for f, t in toks.items()}


def prompt_for(family, body, thinking=False):
    req = parse_tool_request(body)
    if family == "kimi_k2":
        return req, encode_k2(MESSAGES, list(body.get("tools") or []))
    return req, encode_k3(MESSAGES, list(body.get("tools") or []), reasoning_effort=None if thinking else "none",
                          tool_choice=body.get("tool_choice") if isinstance(body.get("tool_choice"), str) else None)


def random_model(tok, grammar, seed: int, max_tokens: int = 1200) -> list[int]:
    """Fresh i.i.d. random logits each step, masked, argmax: a uniform draw among the allowed tokens."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, V)
    out = []
    for step in range(max_tokens):
        if step % 64 == 0:
            logits = torch.rand(64, V, generator=gen)
        assert fill_bitmasks([grammar], bitmask)
        t = int(apply_bitmask_(logits[step % 64:step % 64 + 1], bitmask).argmax())
        assert t < tok.vocab_size
        out.append(t)
        if t in tok.eos_token_ids:
            return out
        assert grammar.accept(t), grammar.error
    raise AssertionError(f"seed {seed}: no stop token in {max_tokens} tokens")


@pytest.mark.parametrize("family", ["kimi_k2", "kimi_k3"])
def test_required_tool_calls_are_schema_valid(family, toks, compilers):
    tok = toks[family]
    body = {"tools": TOOLS, "tool_choice": "required"}
    req, prompt = prompt_for(family, body)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    names_seen = set()
    for seed in range(100):
        out = random_model(tok, compilers[family].for_request(req, prompt), seed)
        p = parse_ids(family, tok, out, id_factory=sequential_ids())
        msg = p.message()
        assert msg["tool_calls"] and msg["content"] is None, (seed, msg)
        streamed = stream(ChatOutputParser(family, tok, id_factory=sequential_ids()), [[t] for t in out], True)
        assert collect(streamed) == msg
        assert p.finish_reason("stop") == "tool_calls"
        for call in msg["tool_calls"]:
            name = call["function"]["name"]
            names_seen.add(name)
            jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[name])
    assert names_seen == set(by_name)


@pytest.mark.parametrize("family", ["kimi_k2", "kimi_k3"])
def test_named_function_is_called_once(family, toks, compilers):
    tok = toks[family]
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}
    req, prompt = prompt_for(family, body)
    for seed in range(30):
        msg = parse_ids(family, tok, random_model(tok, compilers[family].for_request(req, prompt), seed)).message()
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["search"]
        jsonschema.validate(json.loads(msg["tool_calls"][0]["function"]["arguments"]),
                            TOOLS[1]["function"]["parameters"])


@pytest.mark.parametrize("family", ["kimi_k2", "kimi_k3"])
def test_json_schema_output_is_valid(family, toks, compilers):
    tok = toks[family]
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA,
                                                                        "strict": True}}}
    req, prompt = prompt_for(family, body)
    for seed in range(100):
        msg = parse_ids(family, tok, random_model(tok, compilers[family].for_request(req, prompt), seed)).message()
        jsonschema.validate(json.loads(msg["content"]), ANSWER_SCHEMA)


def test_json_object_and_unconstrained(toks, compilers):
    tok = toks["kimi_k2"]
    req, prompt = prompt_for("kimi_k2", {"response_format": {"type": "json_object"}})
    g = compilers["kimi_k2"].for_request(req, prompt)
    for t in tok.encode('{"a": [1, {"b": null}], "c": "x"}'):
        assert g.accept(t), g.error
    assert g.is_finished
    g = compilers["kimi_k2"].for_request(req, prompt)
    assert not g.accept(tok.encode("[")[0])          # an array is JSON but not an object
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}, {}):
        req, prompt = prompt_for("kimi_k2", body)
        assert compilers["kimi_k2"].for_request(req, prompt) is None


def test_no_parallel_calls_and_k2_call_index(toks, compilers):
    tok = toks["kimi_k2"]
    req = parse_tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    history = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.search:4", "function": {"name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.search:4", "content": "none"}]
    prompt = encode_k2(history, TOOLS)
    assert prompt.next_call_index == 5
    for seed in range(10):
        calls = parse_ids("kimi_k2", tok, random_model(tok, compilers["kimi_k2"].for_request(req, prompt),
                                                       seed)).message()["tool_calls"]
        assert len(calls) == 1 and calls[0]["id"].endswith(":5")


def test_k3_thinking_then_call_is_accepted(toks, compilers):
    """A scripted model: free thinking, the think channel closed, then a valid call (and no other way out)."""
    tok = toks["kimi_k3"]
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}}
    req, prompt = prompt_for("kimi_k3", body, thinking=True)
    assert prompt.opens_reasoning
    g = compilers["kimi_k3"].for_request(req, prompt)
    script = ('I should search.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>'
              '<|open|>tools<|sep|><|open|>call tool="search" index="1"<|sep|>'
              '<|open|>argument key="q" type="string"<|sep|>kestrel<|close|>argument<|sep|>'
              '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>')
    ids = tok.encode(script, allow_special=True)
    for t in ids:
        assert g.accept(t), (tok.decode([t], skip_special_tokens=False), g.error)
    assert g.is_finished
    msg = parse_ids("kimi_k3", tok, ids, starts_in_reasoning=True).message()
    assert msg["reasoning_content"] == "I should search."
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"q": "kestrel"}
    # the markup spelled as text is not the markup
    g = compilers["kimi_k3"].for_request(req, prompt)
    spelled = tok.encode("ok", allow_special=False) + tok.encode("<|close|>", allow_special=False)[:1]
    assert g.accept(spelled[0])
    bm = allocate_bitmask(1, V)
    fill_bitmasks([g], bm)
    allowed = ((bm[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:V]
    assert allowed[tok.token_to_id("<|close|>")] == 1 and allowed[tok.token_to_id("<|open|>")] == 0


def test_k3_complex_schema_uses_a_json_element(toks, compilers):
    lark, _ = build_lark("kimi_k3", toks["kimi_k3"], parse_tool_request(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book"}}}),
        encode_k3(MESSAGES, TOOLS, reasoning_effort="none"))
    assert 'json type=\\"object\\"' in lark
    lark, _ = build_lark("kimi_k3", toks["kimi_k3"], parse_tool_request(
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        encode_k3(MESSAGES, TOOLS, reasoning_effort="none"))
    assert 'argument key=\\"city\\" type=\\"string\\"' in lark and "json type" not in lark


def test_apply_bitmask_matches_per_token_reference():
    gen = torch.Generator().manual_seed(3)
    for vocab in (1, 31, 32, 33, 1000):
        bm = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, bitmask_words(vocab)), generator=gen, dtype=torch.int64)
        bm = bm.to(torch.int32)
        logits = torch.randn(3, vocab, generator=gen)
        ref = logits.clone()
        for b in range(3):
            for v in range(vocab):
                if not (int(bm[b, v // 32]) >> (v % 32)) & 1:
                    ref[b, v] = float("-inf")
        assert torch.equal(apply_bitmask_(logits, bm), ref)


def test_rows_without_grammar_are_all_allowed(toks, compilers):
    req, prompt = prompt_for("kimi_k2", {"tools": TOOLS, "tool_choice": "required"})
    g = compilers["kimi_k2"].for_request(req, prompt)
    bm = torch.zeros(3, bitmask_words(V), dtype=torch.int32)
    assert fill_bitmasks([None, g, None], bm)
    assert (bm[0] == -1).all() and (bm[2] == -1).all()
    allowed = ((bm[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:V]
    assert allowed.nonzero().flatten().tolist() == [toks["kimi_k2"].token_to_id("<|tool_calls_section_begin|>")]
    assert not fill_bitmasks([None, None], bm[:2])


def test_errors_name_the_field(toks, compilers):
    with pytest.raises(FieldError) as e:
        parse_tool_request({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert e.value.param == "tool_choice.function.name"
    with pytest.raises(FieldError) as e:
        parse_tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "strin"}}}}}]})
    assert e.value.param == "tools[0].function.parameters.properties.x.type"
    with pytest.raises(FieldError) as e:
        parse_tool_request({"tools": [{"type": "function", "function": {"parameters": {}}}]})
    assert e.value.param == "tools[0].function.name"
    with pytest.raises(FieldError) as e:
        parse_tool_request({"tool_choice": "required"})
    assert e.value.param == "tool_choice"
    with pytest.raises(FieldError) as e:
        parse_tool_request({"response_format": {"type": "yaml"}})
    assert e.value.param == "response_format.type"
    # a schema the grammar library cannot compile: a $ref to nowhere
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}, "required": ["x"]}}}]
    req, prompt = prompt_for("kimi_k2", {"tools": bad, "tool_choice": "required"})
    with pytest.raises(FieldError) as e:
        compilers["kimi_k2"].for_request(req, prompt)
    assert e.value.param == "tools[0].function.parameters" and "missing" in str(e.value)
    with pytest.raises(FieldError) as e:
        compilers["kimi_k2"].check_request(parse_tool_request({"response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
                "a": {"$ref": "#/nowhere"}}}}}}))
    assert e.value.param == "response_format.json_schema.schema"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_apply_bitmask_on_the_device_matches_the_host():
    gen = torch.Generator().manual_seed(5)
    vocab = 163_840
    bm = torch.randint(-2 ** 31, 2 ** 31 - 1, (64, bitmask_words(vocab)), generator=gen, dtype=torch.int64)
    bm = bm.to(torch.int32)
    logits = torch.randn(64, vocab, generator=gen)
    host = apply_bitmask_(logits.clone(), bm)
    dev = apply_bitmask_(logits.cuda(), bm.cuda())
    assert torch.equal(dev.cpu(), host)
