"""`kestrel eval gsm8k` against stub servers: one that answers every question right scores 100%, one that answers
wrong scores 0%; plus the extraction and scoring rules on their own."""

import json
import re

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import serve_helpers as H
from kestrel.cli import main as kestrel_main
from kestrel.errors import KestrelError
from kestrel.eval import gsm8k

DATA = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 eggs. How many eggs are in 5 boxes?",
     "answer": "5 boxes hold 5 * 12 = <<5*12=60>>60 eggs.\n#### 60"},
    {"question": "Sara earns $1,200 a week. How much does she earn in 2 weeks?",
     "answer": "She earns 2 * 1200 = <<2*1200=2400>>2400 dollars.\n#### 2,400"},
    {"question": "The temperature was 5 degrees and fell by 8 degrees. What is it now?",
     "answer": "It is 5 - 8 = <<5-8=-3>>-3 degrees.\n#### -3"},
    {"question": "Half of 9 is what?", "answer": "9 / 2 = <<9/2=4.5>>4.5\n#### 4.5"},
    {"question": "Ann reads 20 pages a day for 7 days. How many pages?",
     "answer": "20 * 7 = <<20*7=140>>140 pages.\n#### 140"},
    {"question": "A shop sells 1000 pens and 250 pencils. How many items in all?",
     "answer": "1000 + 250 = <<1000+250=1250>>1250\n#### 1250"},
]
SHOTS = 2


def stub_app(mode: str, seen: list):
    """Answers /v1/completions for the last question in the prompt: right, wrong, or right only for the flexible
    extraction (no '####')."""
    answers = {d["question"]: gsm8k.reference_answer(d["answer"]) for d in DATA}
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        question = re.findall(r"Question: (.*?)\nAnswer:", body["prompt"])[-1]
        ans = answers[question]
        if mode == "right":
            text = f" Let me think step by step. The result is {ans}.\n#### {ans}"
        elif mode == "wrong":
            text = f" It is {ans}1 after all.\n#### {ans}1"
        else:
            text = f" The answer is {ans}."
        return JSONResponse({"id": "x", "object": "text_completion", "model": body["model"],
                             "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}]})

    return app


@pytest.fixture()
def data_file(tmp_path):
    p = tmp_path / "test.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in DATA))
    return p


@pytest.mark.parametrize("mode, strict, flexible", [("right", 1.0, 1.0), ("wrong", 0.0, 0.0),
                                                    ("flexible_only", 0.0, 1.0)])
def test_gsm8k_cli_with_stub_server(data_file, tmp_path, capsys, mode, strict, flexible):
    seen = []
    out = tmp_path / "gsm8k.json"
    with H.app_in_thread(stub_app(mode, seen)) as url:
        rc = kestrel_main(["eval", "gsm8k", "--url", url, "--data", str(data_file), "--num-fewshot", str(SHOTS),
                           "--concurrency", "3", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr()
    res = json.loads(out.read_text())
    r = res["results"]
    assert r["n"] == len(DATA) - SHOTS and r["num_fewshot"] == SHOTS and r["model"] == "stub-model"
    assert r["score"] == r["strict_match"] == strict
    assert r["flexible_extract"] == flexible
    assert r["strict_match_stderr"] == 0.0
    assert f"strict-match     (score): {strict:.4f}" in printed.out
    assert "gsm8k" in printed.err           # the progress bar
    # the prompts: the first SHOTS examples as worked shots, then the question; greedy, the standard stops
    assert len(seen) == len(DATA) - SHOTS
    for body in seen:
        assert body["prompt"].startswith(f"Question: {DATA[0]['question']}\nAnswer: {DATA[0]['answer']}\n\n"
                                         f"Question: {DATA[1]['question']}\nAnswer: {DATA[1]['answer']}\n\n")
        assert body["prompt"].endswith("\nAnswer:") and body["prompt"].count("Question:") == SHOTS + 1
        assert body["temperature"] == 0 and body["stop"] == ["Question:", "</s>", "<|im_end|>"]
    asked = sorted(re.findall(r"Question: (.*?)\nAnswer:", b["prompt"])[-1] for b in seen)
    assert asked == sorted(d["question"] for d in DATA[SHOTS:])
    assert len(res["samples"]) == len(DATA) - SHOTS


def test_fewshot_file_and_limit(data_file, tmp_path):
    shots = tmp_path / "train.jsonl"
    shots.write_text(json.dumps({"question": "Shot question?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    seen = []
    with H.app_in_thread(stub_app("right", seen)) as url:
        rc = kestrel_main(["eval", "gsm8k", "--url", url, "--data", str(data_file), "--num-fewshot", "1",
                           "--fewshot-data", str(shots), "--limit", "4", "--no-progress"])
    assert rc == 0 and len(seen) == 4
    assert all(b["prompt"].startswith("Question: Shot question?\nAnswer: 1 + 1 = 2\n#### 2\n\nQuestion: ")
               for b in seen)
    assert sorted(re.findall(r"Question: (.*?)\nAnswer:", b["prompt"])[-1] for b in seen) == \
        sorted(d["question"] for d in DATA[:4])


def test_extraction_and_scoring():
    assert gsm8k.reference_answer("work\n#### 1,234") == "1,234"
    assert gsm8k.extract_strict("so #### 1,234.\nQuestion") == "1,234."
    assert gsm8k.extract_strict("#### -3 and #### 5") == "-3"          # the first strict match
    assert gsm8k.extract_strict("The answer is 42") is None
    assert gsm8k.extract_flexible("3 apples, then 4, so $1,200 total.") == "$1,200"
    assert gsm8k.extract_flexible("first 12 then 7") == "7"              # the last number
    assert gsm8k.extract_flexible("no digits") is None
    assert gsm8k.is_correct("1,234.", "1234") and gsm8k.is_correct("$2,400", "2,400")
    assert gsm8k.is_correct("-3", "-3") and not gsm8k.is_correct("3", "-3")
    assert not gsm8k.is_correct("4.50", "4.5") and not gsm8k.is_correct(None, "1")
    res, samples = gsm8k.score(DATA[:4], [" #### 7", "#### 61", "The answer is 2,400", "#### -3."])
    assert res["strict_match"] == 0.5 and res["flexible_extract"] == 0.75
    assert res["strict_match_stderr"] == pytest.approx((0.5 * 0.5 / 3) ** 0.5)
    assert [s["strict"] for s in samples] == ["7", "61", "[invalid]", "-3."]
    assert gsm8k.build_prompt([], "Q?") == "Question: Q?\nAnswer:"


def test_bad_data_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(KestrelError, match="bad.jsonl:1.*####"):
        gsm8k.load_jsonl(str(bad))
    bad.write_text('{"question": "q"\n')
    with pytest.raises(KestrelError, match="bad.jsonl:1: not JSON"):
        gsm8k.load_jsonl(str(bad))
    with pytest.raises(KestrelError, match="none to evaluate"):
        gsm8k.split_examples(DATA[:2], 8, None, None)
    missing = str(tmp_path / "missing.jsonl")
    assert kestrel_main(["eval", "gsm8k", "--url", "http://127.0.0.1:9", "--data", missing]) == 2
