"""AsyncEngine: concurrent streaming generate calls, aborts mid-stream, a consumer that stops reading."""

from __future__ import annotations

import asyncio

import pytest

from test_runtime_helpers import assert_pool_empty, greedy, make_engine, random_prompts

from kestrel.errors import RequestError
from kestrel.runtime.engine import AsyncEngine
from kestrel.sampling_params import SamplingParams

PRESET = "k3-tiny"


@pytest.fixture(scope="module")
def engine():
    return make_engine(PRESET, max_num_seqs=8)


async def _collect(aeng, prompt, params, rid):
    outs = []
    async for out in aeng.generate(prompt, params, rid):
        outs.append(out)
    return outs


def test_concurrent_streams_concatenate_to_the_final_text(engine):
    prompts = ["The kestrel hovers", "红隼在草地上空盘旋", "Birds and flags", "naive cafe", "a"]
    params = [greedy(n) for n in (12, 9, 15, 6, 10)]
    params[2] = SamplingParams(max_tokens=15, temperature=0.9, top_p=0.9, seed=3)

    async def main():
        aeng = AsyncEngine(engine)
        return await asyncio.gather(*(_collect(aeng, p, sp, f"s{i}") for i, (p, sp) in enumerate(zip(prompts,
                                                                                                     params))))

    results = asyncio.run(main())
    for outs, sp in zip(results, params):
        final = outs[-1]
        assert final.finished and final.finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])
        assert "".join(o.delta_text for o in outs) == final.text
        assert sum((o.delta_token_ids for o in outs), []) == final.token_ids
        assert len(final.token_ids) == sp.max_tokens
        assert final.text == engine.tokenizer.decode(final.token_ids)
        m = final.metrics
        assert m.arrival <= m.first_token <= m.finished and m.generated_tokens == sp.max_tokens
    assert not engine.requests                    # finished requests are forgotten
    assert_pool_empty(engine)
    # the streamed tokens are those of a plain offline run
    rid = engine.add_request(prompts[0], greedy(12))
    while engine.has_unfinished():
        engine.step()
    assert engine.final_output(rid).token_ids == results[0][-1].token_ids
    engine.release(rid)


def test_abort_mid_stream_frees_the_pages(engine):
    long_prompt = random_prompts(3, [90])[0]

    async def main():
        aeng = AsyncEngine(engine)
        seen, states = [], {}

        async def victim():
            async for out in aeng.generate(long_prompt, greedy(200), "victim"):
                seen.append(out)
                if len(seen) == 3:
                    req = engine.requests["victim"]
                    states["pages_before"] = len(req.pages)
                    await aeng.abort("victim")
                    states["used_after_abort"] = engine.cache.used_pages
                    other = engine.requests.get("other")
                    states["other_pages"] = len(other.pages) if other is not None else 0
            return seen

        other = asyncio.create_task(_collect(aeng, "The kestrel", greedy(20), "other"))
        v = await asyncio.wait_for(victim(), timeout=120)      # an abort that is never delivered would hang
        return v, await other, states

    seen, other, states = asyncio.run(main())
    assert states["pages_before"] >= 6
    # the stream ends with the abort (a token the running step produced meanwhile may come first)
    assert seen[-1].finish_reason == "abort" and 4 <= len(seen) <= 5
    assert all(o.finish_reason is None for o in seen[:-1])
    assert seen[-1].token_ids == seen[-2].token_ids and seen[-1].delta_token_ids == []
    assert states["used_after_abort"] == states["other_pages"], "the aborted request's pages were not freed"
    assert other[-1].finish_reason == "length" and len(other[-1].token_ids) == 20
    assert not engine.requests
    assert_pool_empty(engine)


def test_consumer_that_stops_reading_releases_its_request(engine):
    async def main():
        aeng = AsyncEngine(engine)
        agen = aeng.generate("The kestrel hovers over", greedy(500), "quitter")
        got = [await agen.__anext__() for _ in range(2)]
        assert engine.requests["quitter"].pages
        await agen.aclose()                        # e.g. the HTTP client went away
        return got

    got = asyncio.run(main())
    assert len(got) == 2 and not got[-1].finished
    assert "quitter" not in engine.requests
    assert_pool_empty(engine)


def test_bad_request_raises_and_engine_keeps_serving(engine):
    async def main():
        aeng = AsyncEngine(engine)
        with pytest.raises(RequestError, match="empty"):
            await _collect(aeng, [], greedy(3), "bad")
        return await _collect(aeng, "ok", greedy(3), "good")

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length"
    assert_pool_empty(engine)


def test_failed_step_fails_the_streams_instead_of_hanging(engine):
    model = engine.runner.model

    def broken(batch, pools):
        raise RuntimeError("device lost")

    async def main():
        aeng = AsyncEngine(engine)
        engine.runner.model = broken
        try:
            with pytest.raises(RuntimeError, match="device lost"):
                await asyncio.wait_for(_collect(aeng, "The kestrel", greedy(5), "doomed"), timeout=60)
        finally:
            engine.runner.model = model

    asyncio.run(main())
    assert not engine.requests
    assert_pool_empty(engine)
