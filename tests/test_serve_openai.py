"""The OpenAI-compatible server through the official `openai` client: every answer equals `LLM.generate` on the same
checkpoint with the same parameters (chat: on the templated token ids)."""

import httpx
import openai
import pytest

import serve_helpers as H
from kestrel import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1 2 3 4"]
MODEL = "tiny"


@pytest.fixture(scope="module")
def srv():
    return H.server()


@pytest.fixture(scope="module")
def llm():
    with H.single_thread():
        yield H.llm()


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=H.API_KEY, max_retries=0, timeout=120) as c:
        yield c


def offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0]


def test_models_health(srv, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0].model_dump()
    assert card["max_model_len"] == H.MAX_MODEL_LEN and card["vocab_size"] == 1024
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0, seed=7),
                                dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, seed=3)])
def test_completion_equals_offline(client, llm, kw):
    extra = {k: kw[k] for k in ("top_k", "min_p") if k in kw}
    std = {k: v for k, v in kw.items() if k not in extra}
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, extra_body=extra, **std)
        ref = offline(llm, prompt, max_tokens=8, **kw)
        assert r.object == "text_completion" and len(r.choices) == 1
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_prompt_forms(client, llm):
    ids = llm.tokenizer.encode("token ids as the prompt")
    r = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, PROMPTS[:2]):
        assert c.text == offline(llm, p, max_tokens=5, temperature=0).text
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"return_token_ids": True})
    ref = offline(llm, ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].model_dump()["token_ids"] == ref.token_ids
    assert r.usage.prompt_tokens == len(ids)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[2] + offline(llm, PROMPTS[2], max_tokens=4, temperature=0).text


def test_chat_equals_offline(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    ids = llm.chat_ids(messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    ref = offline(llm, ids, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    # max_completion_tokens, sampling with a seed, content given as text parts
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi."}]}]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=6, temperature=1.0,
                                       seed=11)
    ref = offline(llm, llm.chat_ids([{"role": "user", "content": "Say\nhi."}]), max_tokens=6, temperature=1.0,
                  seed=11)
    assert r.choices[0].message.content == ref.text


def test_streaming_with_usage(client, llm):
    ref = offline(llm, PROMPTS[1], max_tokens=10, temperature=1.0, seed=5)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=1.0, seed=5,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    body, last = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in body) == ref.text
    assert [c.choices[0].finish_reason for c in body][-1] == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)

    messages = [{"role": "user", "content": "Stream to me."}]
    ref = offline(llm, llm.chat_ids(messages), max_tokens=7, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # without include_usage: no usage anywhere
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                            stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason is not None


def test_raw_stream_ends_with_done(srv):
    with httpx.stream("POST", f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {H.API_KEY}"},
                      json={"prompt": "abc", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1


def test_n_choices_and_seeds(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=100, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.text == offline(llm, PROMPTS[0], max_tokens=6, temperature=1.0, seed=100 + c.index).text
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPTS[0]))
    # the same seed again gives the same answers; streaming n > 1 interleaves choices by index
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=100, n=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    texts = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=100,
                                           n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]
    messages = [{"role": "user", "content": "pick"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=1.0, seed=9, n=2)
    for c in r.choices:
        assert c.message.content == offline(llm, llm.chat_ids(messages), max_tokens=5, temperature=1.0,
                                            seed=9 + c.index).text


def test_logprobs(client, llm):
    ref = offline(llm, PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.tokens == [llm.tokenizer.id_to_piece(t).decode("utf-8", "replace") for t in ref.token_ids]
    for got, (want, alts), top in zip(lp.token_logprobs, ref.logprobs, lp.top_logprobs):
        assert got == pytest.approx(want, abs=1e-4)
        assert 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(alts[0][1], abs=1e-4)
    assert lp.text_offset[0] == 0
    # streamed logprobs add up to the same
    got = []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3,
                                           stream=True):
        got += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    assert got == pytest.approx([w for w, _ in ref.logprobs], abs=1e-4)
    # chat: logprobs=True with top_logprobs alternatives each
    messages = [{"role": "user", "content": "logprobs please"}]
    ref = offline(llm, llm.chat_ids(messages), max_tokens=4, temperature=0, logprobs=2)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([w for w, _ in ref.logprobs], abs=1e-4)
    for c, (_, alts) in zip(content, ref.logprobs):
        assert len(c.top_logprobs) == 2
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([a for _, a in alts[:2]], abs=1e-4)
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_stop_strings(client, llm):
    full = offline(llm, PROMPTS[1], max_tokens=16, temperature=0, ignore_eos=True)
    text = full.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in
                text[i:i + 2])
    ref = offline(llm, PROMPTS[1], max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    assert ref.finish_reason == "stop" and stop not in ref.text and text.startswith(ref.text)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop, "zzzz"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == ref.text
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=12,
                                       temperature=0, stop=["e"])
    assert "e" not in r.choices[0].message.content


def test_user_field_and_api_key(srv, client):
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="someone")
    assert r.choices[0].text is not None
    bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
