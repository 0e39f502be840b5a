"""Tool calls, structured output and reasoning through the server, with the official `openai` client.

Against the live `kestrel serve` subprocess on the random-weight demo model (its tokenizer has K2's tool-call
tokens; its Jinja template writes the prompt): `tool_choice="required"` over three tools of nested schemas gives a
schema-valid call on 100 of 100 seeded requests, `response_format` json_schema gives schema-valid JSON on 100 of
100, and streaming rebuilds the same messages. In-process apps cover the family encodings (`--chat-format
kimi_k2`, and a K3 checkpoint whose tokenizer has XTML tokens and no template), prior tool turns, a model output
that breaks the format (returned as text, never a 5xx) and the engine's grammar hook."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

import serve_helpers as H
from chat_fixtures import ANSWER_SCHEMA, TOOLS

jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? <|tool_calls_section_begin|>"}]
BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
N = 100


@pytest.fixture(scope="module")
def srv():
    return H.server()


def _async_client(url: str, key: str | None = H.API_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key or "none", max_retries=0, timeout=120)


async def _one(client, stream: bool, **kw) -> tuple[dict, str]:
    """(message as a dict, finish_reason) of one chat request; a stream is rebuilt the way a client does."""
    if not stream:
        r = await client.chat.completions.create(model=MODEL, **kw)
        return r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason
    s = await client.chat.completions.create(model=MODEL, stream=True, **kw)
    content, calls, finish, names_sent = "", {}, None, set()
    async for chunk in s:
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in names_sent, "a call's id and name are sent once"
                names_sent.add(tc.index)
                calls[tc.index] = {"id": tc.id, "type": "function",
                                   "function": {"name": tc.function.name, "arguments": ""}}
            calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    msg = {"role": "assistant"}
    if content:
        msg["content"] = content
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


def _run(coro):
    return asyncio.run(coro)


async def _many(url, stream, seeds, **kw):
    async with _async_client(url) as client:
        return await asyncio.gather(*(_one(client, stream, seed=s, **kw) for s in seeds))


def _first(url, stream, seed, **kw):
    """One request (the async client, as the others)."""
    return _run(_many(url, stream, [seed], **kw))[0]


def _without_ids(results):
    return [({**m, "tool_calls": [{**c, "id": None} for c in m.get("tool_calls", [])]}, f) for m, f in results]


def _check_call(msg: dict, finish: str, tool: str | None = None) -> None:
    assert finish == "tool_calls", msg
    assert "content" not in msg and len(msg["tool_calls"]) == 1, msg
    call = msg["tool_calls"][0]
    assert call["type"] == "function" and call["id"]
    name = call["function"]["name"]
    assert tool is None or name == tool
    jsonschema.validate(json.loads(call["function"]["arguments"]), BY_NAME[name])


def test_required_tool_calls_are_schema_valid_and_streams_agree(srv):
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=160,
              temperature=1.0)
    plain = _run(_many(srv.url, False, range(N), **kw))
    for msg, finish in plain:
        _check_call(msg, finish)
    assert {m["tool_calls"][0]["function"]["name"] for m, _ in plain} == set(BY_NAME)
    streamed = _run(_many(srv.url, True, range(20), **kw))
    assert streamed == plain[:20]


def test_json_schema_output_is_valid_and_streams_agree(srv):
    kw = dict(messages=MESSAGES, response_format=JSON_FORMAT, max_tokens=160, temperature=1.0)
    plain = _run(_many(srv.url, False, range(N), **kw))
    for msg, finish in plain:
        assert finish == "stop" and "tool_calls" not in msg
        jsonschema.validate(json.loads(msg["content"]), ANSWER_SCHEMA)
    assert _run(_many(srv.url, True, range(20), **kw)) == plain[:20]


def test_named_function_and_parallel_calls(srv):
    named = _run(_many(srv.url, False, range(10), messages=MESSAGES, tools=TOOLS, max_tokens=160,
                       tool_choice={"type": "function", "function": {"name": "book"}}))
    for msg, finish in named:
        _check_call(msg, finish, "book")
    parallel = _run(_many(srv.url, False, range(10), messages=MESSAGES, tools=TOOLS, tool_choice="required",
                          max_tokens=400))
    for msg, finish in parallel:
        if finish == "length":          # eight calls may not fit; every finished turn must be valid
            continue
        assert finish == "tool_calls" and msg["tool_calls"]
        for k, call in enumerate(msg["tool_calls"]):
            assert call["id"].endswith(f":{k}")
            jsonschema.validate(json.loads(call["function"]["arguments"]), BY_NAME[call["function"]["name"]])


def test_json_object_and_unconstrained_turns(srv):
    # any object: strings are unbounded, so a random model may run out of tokens inside one
    for msg, finish in _run(_many(srv.url, False, range(8), messages=MESSAGES, max_tokens=120,
                                  response_format={"type": "json_object"})):
        assert msg["content"].startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(msg["content"]), dict)
        else:
            assert finish == "length"
    # tools with tool_choice none / auto: no grammar; whatever the random model writes comes back, never a 5xx
    for choice in ("none", "auto"):
        for stream in (False, True):
            msg, finish = _first(srv.url, stream, 5, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                 max_tokens=24, extra_body={"ignore_eos": True})
            assert finish == "length" and msg["role"] == "assistant"
            assert msg.get("content") or msg.get("reasoning_content") or msg.get("tool_calls"), msg
    # a stop string cuts the parsed content where the engine stopped
    msg, finish = _first(srv.url, False, 5, messages=MESSAGES, tools=TOOLS, max_tokens=24, stop=["e"])
    assert "e" not in (msg.get("content") or "") and finish in ("stop", "tool_calls", "length")


def test_prior_tool_turns_are_accepted(srv):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "reasoning_content": "I will look it up.", "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "search", "arguments": '{"q": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny <|im_end|>"}]
    msg, finish = _first(srv.url, False, 1, messages=history, tools=TOOLS, tool_choice="required",
                         parallel_tool_calls=False, max_tokens=160)
    _check_call(msg, finish)
    assert msg["tool_calls"][0]["id"].endswith(":1")     # K2 numbers calls over the conversation


# ---- in-process: the family encodings ------------------------------------------------------------------------

def _engine(model_dir: str):
    from kestrel.config import EngineConfig
    from kestrel.llm import build_engine
    with H.single_thread():
        return build_engine(EngineConfig(model=model_dir, max_model_len=2048))


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    from kestrel.models.kimi.checkpoint import make_checkpoint
    from kestrel.tokenizer import write_demo_tokenizer
    d = str(tmp_path_factory.mktemp("k3chat") / "k3")
    make_checkpoint("k3-tiny", d, layers=2, dtype=torch.float32)
    write_demo_tokenizer(d, 1024, chat_format="kimi_k3")       # XTML control tokens, no Jinja template
    return d


@pytest.mark.parametrize("family", ["kimi_k2", "kimi_k3"])
def test_family_encodings(family, k3_dir):
    from kestrel.serve.api import create_app
    engine = _engine(H.model_dir() if family == "kimi_k2" else k3_dir)
    app = create_app(engine, served_model_name=MODEL, chat_format="kimi_k2" if family == "kimi_k2" else "auto")
    assert app.server.chat.format == family and app.server.chat.tool_parser == family
    required = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                    max_tokens=200, temperature=1.0, reasoning_effort="none")
    with H.single_thread(), H.app_in_thread(app) as url:
        plain = _run(_many(url, False, range(12), **required))
        for msg, finish in plain:
            _check_call(msg, finish)
        # K3 call ids are random per call: compare the rest
        assert _without_ids(_run(_many(url, True, range(12), **required))) == _without_ids(plain)
        for msg, finish in _run(_many(url, False, range(6), messages=MESSAGES, response_format=JSON_FORMAT,
                                      max_tokens=200, reasoning_effort="none")):
            assert finish == "stop"
            jsonschema.validate(json.loads(msg["content"]), ANSWER_SCHEMA)
        # free output (thinking on for K3, tools offered): parsed or returned as text, never a 5xx
        for stream in (False, True):
            msg, finish = _first(url, stream, 2, messages=MESSAGES, tools=TOOLS, max_tokens=40,
                                 extra_body={"ignore_eos": True})
            assert finish == "length"
        if family == "kimi_k3":
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "reasoning_effort": "medium"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_engine_grammar_hook_ends_at_the_grammar(tmp_path):
    """Engine level: a grammar request gets only allowed tokens, stops when the grammar is finished, and a
    request without one in the same batch is not constrained."""
    from kestrel.sampling_params import SamplingParams
    from kestrel.serve.chat.grammar import GrammarCompiler
    from kestrel.serve.chat.k2_encoding import encode_k2
    from kestrel.serve.chat.request import parse_tool_request

    engine = _engine(H.model_dir())
    tok = engine.tokenizer
    gc = GrammarCompiler(tok, engine.config.vocab_size, "kimi_k2", stop_ids=engine.eos_ids)
    treq = parse_tool_request({"response_format": JSON_FORMAT})
    prompt = encode_k2(MESSAGES, [])
    ids = prompt.token_ids(tok)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=4, ignore_eos=True)
    g = gc.for_request(treq, prompt)
    a = engine.add_request(ids, params, grammar=g)
    b = engine.add_request(ids, SamplingParams(max_tokens=30, temperature=1.0, seed=4, ignore_eos=True))
    finals = {}
    with H.single_thread():
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    assert finals[a].finish_reason == "stop" and g.is_finished
    jsonschema.validate(json.loads(tok.decode(list(finals[a].token_ids))), ANSWER_SCHEMA)
    assert finals[b].finish_reason == "length" and len(finals[b].token_ids) == 30
    assert engine._num_grammars == 0


def test_chat_format_flags(k3_dir):
    from kestrel.errors import KestrelError
    from kestrel.serve.chat_format import ChatFormat
    from kestrel.tokenizer import load_tokenizer

    k2, k3 = load_tokenizer(H.model_dir()), load_tokenizer(k3_dir)
    auto = ChatFormat(k2, 1024, k2.eos_token_ids)      # a Jinja template and K2's tokens: the template, K2 parsers
    assert (auto.format, auto.tool_parser, auto.reasoning_parser, auto.thinking) == \
        ("template", "kimi_k2", "kimi_k2", False)
    assert ChatFormat(k3, 1024, k3.eos_token_ids).format == "kimi_k3"
    assert ChatFormat(k2, 1024, k2.eos_token_ids, reasoning_parser="kimi_k2").thinking
    for kwargs, flag in (({"chat_format": "kimi_k3"}, "--chat-format kimi_k3"),
                         ({"tool_call_parser": "kimi_k3"}, "--tool-call-parser kimi_k3"),
                         ({"tool_call_parser": "kimi_k2", "reasoning_parser": "kimi_k3"}, "--tool-call-parser"),
                         ({"chat_format": "jinja"}, "--chat-format jinja")):
        with pytest.raises(KestrelError, match=flag):
            ChatFormat(k2, 1024, k2.eos_token_ids, **kwargs)
