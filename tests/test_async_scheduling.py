"""Async scheduling on the CPU (runtime/engine.py, "Async scheduling"): the same ordering as on a GPU runs here (step
N+1 planned and launched from step N's ids on the device before the host reads them, N's bookkeeping after), each
launch finishing at once. With it on, every request's outputs equal those with it off token for token, text and
finish reason included: greedy and seeded sampling, batches of 1, 3 and 8, both tiny presets, requests ending at
different steps by max_tokens, a stop token id, EOS and a stop string, an abort in the middle, a request arriving while
others decode, decodes crossing page boundaries (page size 16), a pool so short that steps preempt, prefix caching.
A finished or aborted request's pages and slot stay taken while the step launched after its last token may still
write them. tests/test_graphs_cuda.py checks the same under CUDA graphs and that a steady step makes no host sync.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import count_ahead_launches
from test_runtime_helpers import assert_pool_empty, make_engine, random_prompts, run_to_end

from kestrel.cli import build_parser, engine_config
from kestrel.config import EngineConfig
from kestrel.errors import ConfigError
from kestrel.runtime.request import Status
from kestrel.sampling_params import SamplingParams

PRESETS = ("kimi-linear-tiny", "k3-tiny")


def _params(i: int, sampled: bool, **kw) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, **kw)
    return SamplingParams(temperature=0.0, **kw)


def _run(engine, prompts, params, events=None):
    """Run to the end; `events(engine, outputs_so_far)` may add or abort requests between steps. Returns each
    request's (ids, finish reason, text, concatenated delta ids, concatenated delta text), in request order."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    deltas: dict[str, list] = {}
    for _ in range(10000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            d = deltas.setdefault(out.request_id, [[], ""])
            d[0] += out.delta_token_ids
            d[1] += out.delta_text
        if events is not None:
            ids += events(engine, deltas)
    assert not engine.has_unfinished()
    res = []
    for rid in ids:
        out = engine.final_output(rid)
        d = deltas.get(rid, [[], ""])
        res.append((list(out.token_ids), out.finish_reason, out.text, d[0], d[1]))
    return res


def _both(preset, prompts, params_of, events_of=lambda: None, make=None):
    """The run with async scheduling off and on (fresh engines from `make(on)`, default the tiny preset's); asserts
    the on-engine overlapped (some step was launched ahead) and that nothing stays in the pools."""
    results = []
    for on in (False, True):
        engine = make(on) if make is not None else make_engine(preset, async_scheduling=on)
        launches = count_ahead_launches(engine)
        results.append(_run(engine, prompts, params_of(), events_of()))
        assert_pool_empty(engine)
        assert (launches[0] > 0) == on
    return results


def _stops(preset, prompts, sampled):
    """Stop conditions that end requests mid-run, read off a run without them: request 1 stops at the token it
    draws 5th (stop_token_ids), request 2 at a piece of its text (a stop string), request 3 at EOS (its 7th token
    made an EOS id), the others at max_tokens of 6 + 3 i."""
    engine = make_engine(preset)
    free = _run(engine, prompts, [_params(i, sampled, max_tokens=24, ignore_eos=True) for i in range(len(prompts))])
    kw = [dict(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    if len(prompts) > 1:
        kw[1] = dict(max_tokens=24, ignore_eos=True, stop_token_ids=[free[1][0][4]])
    if len(prompts) > 2:
        text = free[2][2]
        kw[2] = dict(max_tokens=24, ignore_eos=True, stop=[text[len(text) // 2:len(text) // 2 + 2]])
    eos = set()
    if len(prompts) > 3:
        kw[3] = dict(max_tokens=24)
        eos = {free[3][0][6]}
    return kw, eos


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_async_equals_sync(preset, batch, sampled):
    prompts = random_prompts(batch * 7 + sampled, [5 + 9 * i for i in range(batch)])
    kw, eos = _stops(preset, prompts, sampled)
    results = []
    for on in (False, True):
        engine = make_engine(preset, async_scheduling=on)
        engine.eos_ids |= eos
        launches = count_ahead_launches(engine)
        results.append(_run(engine, prompts, [_params(i, sampled, **k) for i, k in enumerate(kw)]))
        assert_pool_empty(engine)
        assert (launches[0] > 0) == on
    sync, asyn = results
    assert asyn == sync
    reasons = [r[1] for r in sync]
    if batch > 1:
        assert sync[1][1] == "stop" and len(sync[1][0]) == 5
    if batch > 2:
        assert sync[2][1] == "stop" and len(sync[2][0]) < 24
    if batch > 3:
        assert sync[3][1] == "stop" and len(sync[3][0]) == 7
    assert "length" in reasons
    for ids, _, text, delta_ids, delta_text in sync:
        assert delta_ids == ids and delta_text == text          # streaming deltas add up to the final result


@pytest.mark.parametrize("preset", PRESETS)
def test_async_equals_sync_with_logprobs(preset):
    prompts = random_prompts(3, [7, 19, 30])
    res = []
    for on in (False, True):
        engine = make_engine(preset, async_scheduling=on)
        ids = [engine.add_request(p, _params(i, i == 1, max_tokens=5 + 2 * i, ignore_eos=True, logprobs=2))
               for i, p in enumerate(prompts)]
        run_to_end(engine)
        res.append([(list(engine.final_output(r).token_ids), list(engine.final_output(r).logprobs)) for r in ids])
    assert res[0] == res[1]
    assert all(len(lps) == len(toks) and len(lps[0][1]) == 2 for toks, lps in res[0])


def _abort_after(rid_index: int, tokens: int):
    """An `events` callback: abort the request added `rid_index`-th once it has `tokens` output tokens."""
    done = []

    def events(engine, deltas):
        rid = f"req-{rid_index}"
        if not done and len(deltas.get(rid, [[]])[0]) >= tokens:
            done.append(engine.abort(rid))
        return []
    return events


@pytest.mark.parametrize("preset", PRESETS)
def test_abort_in_the_middle(preset):
    prompts = random_prompts(11, [9, 21, 14])
    sync, asyn = _both(preset, prompts, lambda: [_params(i, i == 2, max_tokens=20, ignore_eos=True)
                                                 for i in range(3)], lambda: _abort_after(1, 4))
    assert asyn == sync
    assert sync[1][1] == "abort" and len(sync[1][0]) == 4


def _arrival(prompt, at: int):
    """An `events` callback: add a request once request 0 has `at` output tokens."""
    added = []

    def events(engine, deltas):
        if not added and len(deltas.get("req-0", [[]])[0]) >= at:
            added.append(engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)))
            return added
        return []
    return events


@pytest.mark.parametrize("preset", PRESETS)
def test_request_arriving_while_others_decode(preset):
    prompts = random_prompts(12, [13, 6])
    late = random_prompts(13, [27])[0]
    sync, asyn = _both(preset, prompts, lambda: [_params(i, i == 1, max_tokens=18, ignore_eos=True) for i in range(2)],
                       lambda: _arrival(late, 5))
    assert len(sync) == 3 and len(sync[2][0]) == 9
    assert asyn == sync


@pytest.mark.parametrize("preset", PRESETS)
def test_short_pool_preempts_the_same(preset):
    """A pool of 12 pages of 16 for three requests growing to 59-70 tokens each (13 pages): steps run short of
    pages (the ahead plan drains, the scheduler preempts) and the outputs still agree."""
    prompts = random_prompts(14, [14, 20, 9])
    kw = dict(kv_cache_tokens=192, max_num_batched_tokens=64)
    preempted = []

    def engine_with(on):
        engine = make_engine(preset, async_scheduling=on, **kw)
        preempted.append(engine.scheduler)
        return engine
    sync, asyn = _both(preset, prompts, lambda: [_params(i, i == 0, max_tokens=50, ignore_eos=True)
                                                 for i in range(3)], make=engine_with)
    assert asyn == sync
    assert all(s.num_preemptions > 0 for s in preempted)


@pytest.mark.parametrize("preset", PRESETS)
def test_prefix_caching_hits_the_same(preset):
    """Requests sharing a 40-token prefix, the later ones arriving while the first decodes: the same hits, the
    same tokens."""
    shared = random_prompts(15, [40])[0]
    tails = random_prompts(16, [3, 9, 17])
    stats = []

    def arrivals():
        added = []

        def events(engine, deltas):
            n = len(deltas.get("req-0", [[]])[0])
            if n >= 2 + 3 * len(added) and len(added) < 2:
                added.append(engine.add_request(shared + tails[1 + len(added)],
                                                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
                return added[-1:]
            return []
        return events

    results = []
    for on in (False, True):
        engine = make_engine(preset, async_scheduling=on)
        results.append(_run(engine, [shared + tails[0]], [_params(0, False, max_tokens=16, ignore_eos=True)],
                            arrivals()))
        stats.append(engine.cache.hit_tokens)
    assert results[0] == results[1] and len(results[0]) == 3
    assert stats[0] == stats[1] > 0


@pytest.mark.parametrize("preset", ["k3-tiny"])
def test_pages_and_slot_held_while_a_launched_step_can_write_them(preset):
    """Request 0 stops at a stop token (known only once its token is read, so the step launched after it still
    computes its row): when its final output comes back, its slot and pages are still taken, and that launched
    step holds them; the next step completes it and they go back. An abort while a step with the request's row is
    in flight is the same."""
    prompts = random_prompts(17, [11, 23, 8])
    probe = make_engine(preset)
    free = _run(probe, prompts[:1], [_params(0, False, max_tokens=12, ignore_eos=True)])
    stop_at = free[0][0][3]
    engine = make_engine(preset, async_scheduling=True)
    ids = [engine.add_request(p, _params(i, False, max_tokens=30, ignore_eos=True,
                                         stop_token_ids=[stop_at] if i == 0 else []))
           for i, p in enumerate(prompts)]
    reqs = [engine.requests[r] for r in ids]
    c = engine.cache

    def held(req, slot, pages):
        return slot not in c.free_slots and all(c.ref[p] > 0 for p in pages)

    ended = None
    while ended is None:
        for out in engine.step():
            if out.request_id == ids[0] and out.finished:
                ended = out
    req = reqs[0]
    assert ended.finish_reason == "stop" and req.status == Status.FINISHED
    slot, pages = _slot_and_pages(engine, req)
    assert engine._inflight is not None and id(req) in engine._inflight.rows
    assert req not in engine.scheduler.running and held(req, slot, pages)
    # a newcomer now gets neither: the pipeline drains first (completing the launched step), then admits it
    late = engine.add_request(random_prompts(18, [5])[0], SamplingParams(temperature=0.0, max_tokens=3,
                                                                          ignore_eos=True))
    outs = engine.step()
    assert all(o.request_id != ids[0] for o in outs)       # the dropped row's token is never handed out
    assert not held(req, slot, pages) and req.slot is None
    assert len(engine.final_output(ids[0]).token_ids) == 4
    # abort request 1 while a step computing its row is in flight
    while engine._inflight is None or id(reqs[1]) not in engine._inflight.rows:
        engine.step()
    slot, pages = _slot_and_pages(engine, reqs[1])
    n = len(reqs[1].output_token_ids)
    assert engine.abort(ids[1]).finish_reason == "abort"
    assert held(reqs[1], slot, pages)
    engine.step()
    assert not held(reqs[1], slot, pages) and len(engine.final_output(ids[1]).token_ids) == n
    run_to_end(engine)
    assert len(engine.final_output(late).token_ids) == 3
    assert_pool_empty(engine)


def _slot_and_pages(engine, req):
    """The slot and pages a request held at its last step (kept on the launched step's release list)."""
    assert req.slot is not None and req.pages
    return req.slot, list(req.pages)


def test_async_engine_streams_the_same():
    """AsyncEngine over an async-scheduling engine: each stream's deltas add up to what the synchronous engine
    gives, and every stream ends."""
    prompts = random_prompts(19, [6, 17, 25])

    async def stream(engine):
        from kestrel.runtime.engine import AsyncEngine
        ae = AsyncEngine(engine)

        async def one(i, p):
            toks = []
            async for out in ae.generate(p, _params(i, i == 1, max_tokens=7 + 2 * i, ignore_eos=True), f"s{i}"):
                toks += out.delta_token_ids
                last = out
            return toks, last.finish_reason
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    got = [asyncio.run(stream(make_engine("k3-tiny", async_scheduling=on))) for on in (False, True)]
    assert got[0] == got[1] and all(r == "length" for _, r in got[0])


def test_config_and_flags():
    assert EngineConfig(model="m").async_scheduling is None            # auto: on where CUDA graphs are on
    assert make_engine("k3-tiny").async_scheduling is False            # the CPU engine: no graphs, so off
    with pytest.raises(ConfigError, match="async-scheduling"):
        EngineConfig(model="m", async_scheduling="yes")
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(model="m", async_scheduling=True,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="one rank"):
        EngineConfig(model="m", async_scheduling=True, tensor_parallel_size=2)
    p = build_parser()
    for argv, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        args = p.parse_args(["generate", "--model", "m", *argv, "hi"])
        assert engine_config(args).async_scheduling is want


def test_a_failed_launch_keeps_the_previous_step_in_flight():
    """The model raises while the next step is launched ahead: the step before stays in flight, so the aborts that
    follow (AsyncEngine fails every request) release pages and slots only once it is completed, and the pools end
    empty."""
    engine = make_engine("kimi-linear-tiny", async_scheduling=True)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
           for p in random_prompts(20, [7, 15])]
    while engine._inflight is None:
        engine.step()
    runner = engine.runner

    def broken(batch):
        raise RuntimeError("device lost")
    engine.runner = broken
    with pytest.raises(RuntimeError):
        engine.step()
    engine.runner = runner
    step = engine._inflight
    assert step is not None
    for rid in ids:
        engine.abort(rid)
    assert {id(r) for r in step.release_after} == {id(engine.requests[r]) for r in ids}
    assert engine.cache.used_slots == 2
    while engine.has_unfinished():
        assert engine.step() == []
    assert_pool_empty(engine)


@pytest.mark.parametrize("preset", PRESETS)
def test_max_model_len_ends_the_same(preset):
    """Requests running into --max-model-len (40) end by length at the same token (the plan ahead gives no row to a
    request whose next token is its last)."""
    prompts = random_prompts(21, [30, 12, 25])
    sync, asyn = _both(preset, prompts, lambda: [_params(i, i == 1, max_tokens=100, ignore_eos=True)
                                                 for i in range(3)],
                       make=lambda on: make_engine(preset, async_scheduling=on, max_model_len=40))
    assert asyn == sync
    assert [len(r[0]) for r in sync] == [10, 28, 15] and all(r[1] == "length" for r in sync)


class _EveryThird:
    """A stand-in grammar whose allowed tokens depend on what it accepted: token ids = n mod 3 after n tokens;
    finished after 6. A step launched ahead of its last token could not know its mask."""

    def __init__(self, vocab: int):
        self.vocab, self.n = vocab, 0

    def fill(self, row):
        import torch
        allowed = torch.zeros(row.numel() * 32, dtype=torch.bool)
        allowed[self.n % 3:self.vocab:3] = True
        words = (allowed.view(-1, 32).long() << torch.arange(32)).sum(1)        # 0 .. 2**32 - 1
        row.copy_(torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32))

    def accept(self, token: int) -> bool:
        ok = token % 3 == self.n % 3
        self.n += 1
        return ok

    @property
    def is_finished(self) -> bool:
        return self.n >= 6


def test_a_grammar_request_runs_synchronously():
    """Beside a grammar-constrained request no step is launched ahead (its mask needs its last token on the host);
    once it finished the others overlap again, and every output equals the synchronous run."""
    prompts = random_prompts(22, [9, 14, 6])
    results, ahead = [], []
    for on in (False, True):
        engine = make_engine("k3-tiny", async_scheduling=on)
        launches = count_ahead_launches(engine)
        rids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                   grammar=_EveryThird(engine.config.vocab_size) if i == 0 else None)
                for i, p in enumerate(prompts)]
        while engine.requests[rids[0]].status != Status.FINISHED:
            engine.step()
        ahead.append(launches[0])
        run_to_end(engine)
        ahead.append(launches[0])
        results.append([list(engine.final_output(r).token_ids) for r in rids])
        assert_pool_empty(engine)
    assert results[0] == results[1]
    assert len(results[0][0]) == 6 and all(t % 3 == i % 3 for i, t in enumerate(results[0][0]))
    assert ahead[2] == 0 and ahead[3] > 0          # none beside the grammar request, some after it
