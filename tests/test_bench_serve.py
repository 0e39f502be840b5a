"""`kestrel bench serve`: 200 concurrent streams against the real server, every stream well formed and every output
equal to the offline result for its seed; the stream checker catches malformed streams; the subcommand registers."""

import argparse
import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import serve_helpers as H
from kestrel import SamplingParams
from kestrel.bench import serve as bench


@pytest.fixture(scope="module")
def srv():
    return H.server()


@pytest.fixture(scope="module")
def llm():
    with H.single_thread():
        yield H.llm()


def test_200_concurrent_streams_equal_offline(srv, llm, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = bench.main(["--url", srv.url, "--num-prompts", "200", "--input-len", "8", "--output-len", "6",
                     "--concurrency", "200", "--temperature", "1.0", "--sampling-seed", "1000", "--seed", "3",
                     "--api-key", H.API_KEY, "--save-outputs", "--out", str(out)])
    table = capsys.readouterr().out
    assert rc == 0, table
    assert "Successful requests:" in table and "Time to first token" in table
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["completed"] == 200 and s["errors"] == 0, s["error_messages"]
    assert s["output_tokens"] == 200 * 6 and s["input_tokens"] == 200 * 8
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    reqs = res["requests"]
    assert [r["seed"] for r in reqs] == list(range(1000, 1200))
    with H.single_thread():
        refs = llm.generate([r["prompt"] for r in reqs],
                            [SamplingParams(max_tokens=6, temperature=1.0, seed=r["seed"], ignore_eos=True)
                             for r in reqs])
    for r, ref in zip(reqs, refs):
        assert r["ok"] and r["finish_reason"] == "length"
        assert r["token_ids"] == ref.token_ids
        assert r["text"] == ref.text
        assert len(r["itl"]) == 5
    m = H.wait_metrics(srv.url, lambda m: H.metric_value(m, "num_requests_running") == 0
                       and H.metric_value(m, "kv_cache_used_pages") == 0)
    assert H.metric_value(m, "num_http_requests_in_flight") == 0


def test_dataset_prompts(srv, llm, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"prompt number {i}", "max_tokens": 4 + i % 5} for i in range(10)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = bench.dataset_specs(str(data), 12, output_len=99)
    assert [s.max_tokens for s in specs] == [4 + i % 5 for i in range(10)] + [4, 5]
    summary, results = asyncio.run(bench.run_benchmark(srv.url, specs, concurrency=4, request_rate=50.0,
                                                       api_key=H.API_KEY, keep_text=True, ignore_eos=False))
    assert summary["errors"] == 0 and summary["completed"] == 12
    with H.single_thread():
        refs = llm.generate([s.prompt for s in specs], [SamplingParams(max_tokens=s.max_tokens, temperature=0)
                                                        for s in specs])
    assert [r.text for r in results] == [ref.text for ref in refs]


# ---- the stream checker, against a stub server that misbehaves on request --------------------------------

def _stub_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model", "vocab_size": 100}]}

    def ev(obj):
        return f"data: {json.dumps(obj)}\n\n"

    def chunk(text, finish=None, ids=None):
        c = {"index": 0, "text": text, "finish_reason": finish}
        if ids is not None:
            c["token_ids"] = ids
        return ev({"object": "text_completion", "choices": [c], "usage": None})

    usage = ev({"object": "text_completion", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})
    streams = {
        "good": [chunk("a", ids=[1]), chunk("b", "length", ids=[2]), usage, "data: [DONE]\n\n"],
        "no_done": [chunk("a", ids=[1]), chunk("b", "length", ids=[2]), usage],
        "not_json": [chunk("a", ids=[1]), "data: {oops\n\n", "data: [DONE]\n\n"],
        "after_done": [chunk("a", ids=[1]), chunk("b", "length", ids=[2]), usage, "data: [DONE]\n\n",
                       chunk("c")],
        "usage_mismatch": [chunk("a", ids=[1]), chunk("b", "length", ids=[2, 3]), usage, "data: [DONE]\n\n"],
        "no_finish": [chunk("a", ids=[1]), chunk("b", ids=[2]), usage, "data: [DONE]\n\n"],
        "error_event": [chunk("a", ids=[1]), ev({"error": {"message": "boom"}}), "data: [DONE]\n\n"],
    }

    @app.post("/v1/completions")
    async def completions(request: Request):
        mode = (await request.json())["prompt"]
        if mode == "http_500":
            return JSONResponse({"error": {"message": "server on fire", "type": "server_error", "param": None,
                                           "code": None}}, status_code=500)

        async def gen():
            for part in streams[mode]:
                yield part
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def test_stream_checker_catches_malformed_streams():
    modes = ["good", "no_done", "not_json", "after_done", "usage_mismatch", "no_finish", "error_event", "http_500"]
    specs = [bench.RequestSpec(i, m, 2) for i, m in enumerate(modes)]
    with H.app_in_thread(_stub_app()) as url:
        summary, results = asyncio.run(bench.run_benchmark(url, specs, concurrency=8))
    by_mode = dict(zip(modes, results))
    assert by_mode["good"].ok and by_mode["good"].output_tokens == 2
    assert summary["completed"] == 1 and summary["errors"] == len(modes) - 1
    expect = {"no_done": "[DONE]", "not_json": "not JSON", "after_done": "after [DONE]",
              "usage_mismatch": "usage says", "no_finish": "never finished", "error_event": "boom",
              "http_500": "server on fire"}
    for mode, text in expect.items():
        assert not by_mode[mode].ok and text in by_mode[mode].error, (mode, by_mode[mode].error)


def test_register_serve_and_helpers():
    ap = argparse.ArgumentParser(prog="kestrel")
    sub = ap.add_subparsers(dest="command")
    b = sub.add_parser("bench")
    bench.register_serve(b.add_subparsers(dest="bench_command"))
    args = ap.parse_args(["bench", "serve", "--url", "http://h:1", "--num-prompts", "3", "--input-len", "4",
                          "--output-len", "2", "--concurrency", "2", "--request-rate", "5", "--dataset", "d.jsonl",
                          "--out", "r.json"])
    assert args.func is bench.cmd_bench_serve
    assert (args.num_prompts, args.input_len, args.output_len, args.concurrency, args.request_rate) == (3, 4, 2, 2, 5)
    assert bench.percentile([1, 2, 3, 4], 50) == 2.5 and bench.percentile([5], 99) == 5
    specs = bench.random_specs(3, 4, 2, vocab_size=10, seed=1, sampling_seed=7)
    assert [len(s.prompt) for s in specs] == [4, 4, 4] and [s.seed for s in specs] == [7, 8, 9]
    assert all(0 <= t < 10 for s in specs for t in s.prompt)
    assert specs == bench.random_specs(3, 4, 2, vocab_size=10, seed=1, sampling_seed=7)
