"""Bad requests get the right status and OpenAI's error shape, and the server keeps answering correctly after each;
a client that goes away has its engine request aborted and its cache freed (seen in /metrics)."""

import json
import socket
from urllib.parse import urlparse

import httpx
import pytest

import serve_helpers as H
from serve_helpers import assert_error_shape
from kestrel import SamplingParams

AUTH = {"Authorization": f"Bearer {H.API_KEY}"}
GOOD = {"model": "tiny", "prompt": "a good request", "max_tokens": 3, "temperature": 0}
LONG_PROMPT = "hello " * (H.MAX_MODEL_LEN + 10)

# (route, body: dict or raw bytes, status, param the error names)
BAD = [
    ("/v1/completions", b"{\"prompt\": \"x\",", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"\xff\xfe not utf-8", 400, None),
    ("/v1/chat/completions", b"{not json}", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 5000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": H.MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 6},
     400, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -7}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": True}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "true"}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "user": 42}, 400, "user"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "str"}}}}}]}, 400, "tools[0].function.parameters.properties.a.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                          "function": {"name": "g"}}}, 400,
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(unclosed"}}}}}]}, 400, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "[z-a]"}}}},
     400, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "huge"}, 400,
     "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]},
     400, "messages[0].tool_calls[0].function"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
]


@pytest.fixture(scope="module")
def srv():
    return H.server()


@pytest.fixture(scope="module")
def good_text():
    with H.single_thread():
        return H.llm().generate([GOOD["prompt"]], SamplingParams(max_tokens=3, temperature=0))[0].text


_client = httpx.Client(headers=AUTH, timeout=60)


def assert_good(srv, good_text):
    r = _client.post(f"{srv.url}/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == good_text


def test_bad_requests(srv, good_text):
    with httpx.Client(headers=AUTH, timeout=60) as c:
        for route, body, status, param in BAD:
            if isinstance(body, bytes):
                r = c.post(f"{srv.url}{route}", content=body, headers={"Content-Type": "application/json"})
            else:
                r = c.post(f"{srv.url}{route}", json=body)
            err = assert_error_shape(r, status, param)
            if status == 404:
                assert err["code"] == "model_not_found"
            assert_good(srv, good_text)
        # a streaming request that is bad is refused before any stream starts
        r = c.post(f"{srv.url}/v1/completions", json={"prompt": LONG_PROMPT, "stream": True})
        assert assert_error_shape(r, 400, "prompt")["code"] == "context_length_exceeded"
    assert_good(srv, good_text)


def test_unknown_routes_and_methods(srv):
    assert_error_shape(httpx.get(f"{srv.url}/v1/nothing", headers=AUTH), 404, None)
    assert_error_shape(httpx.get(f"{srv.url}/v1/completions", headers=AUTH), 405, None)
    assert_error_shape(httpx.get(f"{srv.url}/v1/models/other", headers=AUTH), 404, "model")
    assert httpx.get(f"{srv.url}/v1/models/tiny", headers=AUTH).json()["id"] == "tiny"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": H.API_KEY},
                                     {"Authorization": "Basic dGVzdC1rZXk="}])
def test_api_key(srv, good_text, headers):
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/v1/models/tiny"), ("GET", "/nothing")]:
        r = httpx.request(method, f"{srv.url}{path}", headers=headers, json=GOOD)
        err = assert_error_shape(r, 401, None)
        assert err["code"] == "invalid_api_key"
    assert httpx.get(f"{srv.url}/health", headers=headers).status_code == 200
    assert_good(srv, good_text)


def idle(m):
    return (H.metric_value(m, "num_requests_running") == 0 and H.metric_value(m, "num_requests_waiting") == 0
            and H.metric_value(m, "kv_cache_used_pages") == 0 and H.metric_value(m, "kda_state_used_slots") == 0)


def test_disconnected_stream_is_aborted(srv, good_text):
    before = H.wait_metrics(srv.url, idle)
    aborted0 = H.metric_value(before, "request_success_total", finish_reason="abort")
    body = {"prompt": "a long story", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(headers=AUTH, timeout=60) as c:
        with c.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert got[0].startswith("data: ")
            m = H.metrics(srv.url)
            assert H.metric_value(m, "num_requests_running") == 1
            assert H.metric_value(m, "kv_cache_used_pages") >= 1
        # leaving the block closes the connection mid-stream
    after = H.wait_metrics(srv.url, idle)
    assert H.metric_value(after, "request_success_total", finish_reason="abort") == aborted0 + 1
    assert_good(srv, good_text)
    log = srv.log()      # one line for the disconnect, no traceback
    assert log.count("disconnected mid-stream") >= 1 and "Traceback" not in log


def test_disconnected_plain_request_is_aborted(srv, good_text):
    before = H.wait_metrics(srv.url, idle)
    aborted0 = H.metric_value(before, "request_success_total", finish_reason="abort")
    u = urlparse(srv.url)
    body = json.dumps({"prompt": "n = 2 choices, both long", "max_tokens": 400, "ignore_eos": True, "n": 2}).encode()
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + u.netloc.encode() + b"\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {H.API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    H.wait_metrics(srv.url, lambda m: H.metric_value(m, "num_requests_running") == 2)
    s.close()
    after = H.wait_metrics(srv.url, idle)
    assert H.metric_value(after, "request_success_total", finish_reason="abort") == aborted0 + 2
    assert_good(srv, good_text)
    log = srv.log()
    assert "aborted its 2 engine request(s)" in log and "Traceback" not in log


def test_metrics_page(srv, good_text):
    assert_good(srv, good_text)
    assert _client.post(f"{srv.url}/v1/completions", json={"prompt": "x", "n": 0}).status_code == 400
    r = httpx.get(f"{srv.url}/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_used_pages",
                 "prefix_cache_hit_rate", "prompt_tokens_total", "generation_tokens_total"):
        assert f"# TYPE kestrel_{name} " in text
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE kestrel_{name} histogram" in text
        assert f'kestrel_{name}_bucket{{le="+Inf",model_name="tiny"}}' in text
    # a repeated long prompt is served from the prefix cache: the hit rate and cached_tokens show it
    long = {"prompt": "the same long prefix " * 40, "max_tokens": 2, "temperature": 0}
    first = _client.post(f"{srv.url}/v1/completions", json=long).json()
    second = _client.post(f"{srv.url}/v1/completions", json=long).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    m = H.metrics(srv.url)
    assert H.metric_value(m, "prefix_cache_hit_rate") > 0
    assert H.metric_value(m, "e2e_request_latency_seconds_count") >= 1
    assert H.metric_value(m, "generation_tokens_total") >= 3
    assert H.metric_value(m, "http_responses_total", code="400") >= 1


def test_engine_failure_is_a_500_and_the_server_recovers(good_text):
    """A step that raises fails the requests it held with a 500 (never hangs them); the next request runs again."""
    from kestrel.config import EngineConfig
    from kestrel.llm import build_engine
    from kestrel.serve.api import create_app
    with H.single_thread():
        engine = build_engine(EngineConfig(model=H.model_dir(), max_model_len=H.MAX_MODEL_LEN))
    real_step, calls = engine.step, {"n": 0, "fail": {2}}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] in calls["fail"]:
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = flaky_step
    app = create_app(engine)
    with H.single_thread(), H.app_in_thread(app) as url:
        r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
        err = assert_error_shape(r, 500, None)
        assert "injected failure" in err["message"]
        r = httpx.post(f"{url}/v1/completions", json={**GOOD, "stream": True}, timeout=30)
        assert r.status_code == 200 and r.text.startswith("data: ")
        r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == good_text
        # a stream that fails after its headers ends with an SSE error event and [DONE], not a cut connection
        calls["fail"] = {calls["n"] + 3}
        with httpx.stream("POST", f"{url}/v1/completions", json={**GOOD, "max_tokens": 8, "stream": True},
                          timeout=30) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and "injected failure" in json.loads(events[-2][6:])["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200 and "injected failure" in health.json()["last_engine_error"]
        assert engine.stats()["used_pages"] == 0 and engine.stats()["running"] == 0


def test_serve_on_a_taken_port_is_a_one_line_error(capsys):
    from kestrel.cli import main
    sock = H.free_socket()
    try:
        rc = main(["serve", "--model", H.model_dir(), "--port", str(sock.getsockname()[1])])
    finally:
        sock.close()
    err = capsys.readouterr().err
    assert rc == 2 and "kestrel: error: --host 127.0.0.1 --port" in err and "cannot listen there" in err
    assert "Traceback" not in err
