"""Property tests of the scheduler + cache under random arrivals, aborts and finishes, with a fake model.

The fake model does no math, but it keeps the cache honest: it writes each token id into its MLA page slot and keeps
(token count, rolling hash of the tokens) as the KDA "state" of the request's slot, copies it to snapshot slots as
asked, and before reading a segment checks that the pages and the state hold exactly the request's earlier tokens
(so a prefix hit that restored the wrong pages or snapshot is caught). Its logits are pseudo-random but a function
of that hash, so every request's output is a function of its prompt alone: batching, chunking, preemption and
prefix hits must never change it. After every step the cache's invariants are checked: refcounts equal the number
of live owners (sharing only through cached prefix pages), no leak (free + evictable + used == num_pages), block
table rows equal request.pages, slots and snapshots are each owned once. Each trace runs with async scheduling off
or on (runtime/engine.py): on, a decode step is launched before the host appended the previous step's tokens, so the
model sees one token more than the host holds (checked against the outputs at the end), and a request that ended
while a launched step still computes its row keeps its pages and slot until that step completed (an owner too).
"""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kestrel.config import EngineConfig, ModelConfig
from kestrel.errors import RequestError
from kestrel.models.kimi.checkpoint import preset_config
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.engine import Engine
from kestrel.runtime.request import Status
from kestrel.runtime.sampler import Sampler
from kestrel.sampling_params import SamplingParams

torch.set_num_threads(1)

CONFIG = ModelConfig.from_dict(preset_config("kimi-linear-tiny"))
VOCAB = CONFIG.vocab_size
MOD = 1_000_003                      # hash values stay below 2**24: exact in the fp32 state
EOS = set(range(1, 41))              # ~4% of argmaxes end a request
BASES = [[random.Random(s).randrange(41, VOCAB) for _ in range(80)] for s in range(3)]


def _h(h: int, tok: int) -> int:
    return (h * 1031 + tok + 1) % MOD


def _hash(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = _h(h, t)
    return h


def _logits(h: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(h))


class FakeModel:
    def __init__(self):
        self.engine: Engine | None = None
        self.steps = 0

    def __call__(self, batch, pools):
        eng = self.engine
        self.steps += 1
        by_slot = {r.slot: r for r in eng.scheduler.running}
        assert len(by_slot) == len(eng.scheduler.running)
        mla = pools.mla[min(pools.mla)]
        rec = pools.recurrent[min(pools.recurrent)]
        ps = mla.shape[1]
        snaps = dict(batch.snapshots)
        assert batch.cu_seqlens[-1] == batch.token_ids.shape[0] == batch.positions.shape[0]
        row_hash = {}
        live = batch.num_reqs - batch.padded_rows
        for b in range(batch.num_reqs):
            s, e = batch.cu_seqlens[b], batch.cu_seqlens[b + 1]
            slot = int(batch.slots[b])
            if b >= live:       # decode padding to a graph bucket (runtime/graphs.py): the scratch slot only
                assert slot == eng.cache.scratch_slot and set(batch.block_tables[b].tolist()) == {eng.cache.scratch_page}
                continue
            req = by_slot[slot]
            ctx = batch.context_lens[b]
            toks = req.all_token_ids
            assert batch.positions[s:e].tolist() == list(range(ctx, ctx + e - s))
            got = batch.token_ids[s:e].tolist()
            assert got[:len(toks) - ctx] == toks[ctx:e - s + ctx]
            if len(toks) < ctx + e - s:      # launched ahead: the one token the host has not appended yet
                assert eng.async_scheduling and e - s == 1 and len(toks) == ctx
                toks = toks + got
            row = batch.block_tables[b].tolist()
            assert row[:len(req.pages)] == req.pages and set(row[len(req.pages):]) <= {-1}
            assert len(req.pages) * ps >= ctx + e - s
            for pos in range(ctx):                 # the cache holds exactly the earlier tokens ...
                assert int(mla[row[pos // ps], pos % ps, 0]) == toks[pos], "a page holds a wrong token"
            count, h = int(rec[slot, 0, 0, 0]), int(rec[slot, 0, 0, 1])
            assert (count, h) == (ctx, _hash(toks[:ctx])), "the KDA state does not match the tokens before it"
            for i, pos in enumerate(range(ctx, ctx + e - s)):   # ... and gets this segment's tokens
                mla[row[pos // ps], pos % ps, 0] = toks[pos]
                h = _h(h, toks[pos])
                row_hash[s + i] = h
            rec[slot, 0, 0, 0], rec[slot, 0, 0, 1] = ctx + e - s, h
            if b in snaps:
                assert snaps[b] >= eng.cache.num_slots and (ctx + e - s) % ps == 0
                for t in list(pools.recurrent.values()) + list(pools.conv.values()):
                    t[snaps[b]] = t[slot]
        return torch.stack([_logits(row_hash[r]) if r in row_hash else torch.zeros(VOCAB)
                            for r in batch.logits_indices.tolist()]) \
            if batch.logits_indices.numel() else torch.empty(0, VOCAB)


def expected_output(prompt: list[int], params: SamplingParams, seed: int, max_len: int) -> list[int]:
    """The request run alone against the fake model, by hand."""
    sampler = Sampler(1, VOCAB, torch.device("cpu"))
    row = sampler.row(params, seed)
    h, out = _hash(prompt), []
    while True:
        flags = sampler.prepare([row], [len(prompt) + len(out)], None)
        tok = sampler.sample(_logits(h)[None], flags).token_ids.tolist()[0]
        out.append(tok)
        if tok in EOS or len(out) >= params.max_tokens or len(prompt) + len(out) >= max_len:
            return out
        h = _h(h, tok)


def check_invariants(engine: Engine) -> None:
    c, sch = engine.cache, engine.scheduler
    running, waiting = sch.running, list(sch.waiting)
    assert len(running) <= sch.max_num_seqs
    assert not set(map(id, running)) & set(map(id, waiting))
    for r in waiting:
        assert r.slot is None and not r.pages and r.status == Status.WAITING
    # async scheduling: requests that ended while the launched step computes their row hold their pages and slot
    ended = engine._inflight.release_after if engine._inflight is not None else []
    assert all(r.status == Status.FINISHED and r.slot is not None for r in ended)
    assert not engine.async_scheduling or engine._inflight is None or all(
        r.status != Status.RUNNING or r.num_computed == r.num_tokens for r in engine._inflight.reqs)
    owners = [0] * c.num_pages
    for r in ended:
        for p in r.pages:
            owners[p] += 1
    for r in running:
        assert r.status == Status.RUNNING and r.slot is not None
        assert len(set(r.pages)) == len(r.pages), "a request holds a page twice"
        assert len(r.pages) * c.page_size >= r.num_computed
        for p in r.pages:
            owners[p] += 1
    assert all(x >= 0 for x in c.ref), "negative refcount"
    assert c.ref == owners, "refcounts must equal the number of live owners"
    for p, n in enumerate(owners):
        if n > 1:
            assert c.page_key[p] is not None, "pages are shared only through the prefix cache"
    free, evictable = set(c.free_pages), set(c.evictable)
    assert len(free) == len(c.free_pages) and not free & evictable
    used = {p for p in range(c.num_pages) if c.ref[p] > 0}
    assert not used & (free | evictable)
    assert len(free) + len(evictable) + len(used) == c.num_pages, "a page leaked"
    assert c.used_pages == len(used)
    assert all(c.page_key[p] is None for p in free) and all(c.page_key[p] is not None for p in evictable)
    for key, p in c.page_of_key.items():
        assert c.page_key[p] == key
    assert sum(k is not None for k in c.page_key) == len(c.page_of_key)
    # slots: each running request owns one, the rest are free; block table rows match request.pages
    slots = [r.slot for r in running + ended]
    assert len(set(slots)) == len(slots)
    assert sorted(slots + list(c.free_slots)) == list(range(c.num_slots))
    for r in running + ended:
        row = c.block_tables_host[r.slot].tolist()
        assert row == r.pages + [-1] * (c.max_pages_per_seq - len(r.pages))
    for s in c.free_slots:
        assert bool((c.block_tables_host[s] == -1).all())
    snaps = list(c.snapshot_of_key.values())
    assert len(set(snaps)) == len(snaps)
    assert sorted(snaps + list(c.free_snapshots)) == list(range(c.num_slots, c.num_slots + c.num_snapshots))


def build(page_size: int, num_pages: int, max_seqs: int, budget: int, prefix: bool, max_model_len: int,
          snapshots: int | None = None, async_scheduling: bool = False) -> Engine:
    ec = EngineConfig(model="fake", page_size=page_size, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      enable_prefix_caching=prefix, max_model_len=max_model_len, async_scheduling=async_scheduling)
    max_pages = min(-(-max_model_len // page_size), num_pages)
    snapshots = (max_seqs if snapshots is None else snapshots) if prefix else 0
    cache = HybridCache(CONFIG, num_pages, page_size, max_seqs, snapshots, max_pages,
                        torch.float32, torch.device("cpu"), prefix)
    model = FakeModel()
    engine = Engine(CONFIG, ec, model, cache)
    model.engine = engine
    engine.eos_ids = set(EOS)
    return engine


def random_trace(rnd: random.Random) -> list[tuple]:
    """Arrivals (prompts sharing prefixes of three base sequences), runs of steps and aborts."""
    ops = []
    for _ in range(rnd.randint(8, 30)):
        x = rnd.random()
        if x < 0.55:
            ops.append(("add", rnd.randrange(3), rnd.choice([0, 5, 16, 24, 40, 40, 64, 64, 80]), rnd.randint(0, 12),
                        rnd.randint(1, 24), rnd.random() < 0.3))
        elif x < 0.9:
            ops.append(("step", rnd.randint(1, 3)))
        else:
            ops.append(("abort", rnd.randrange(1000)))
    return ops


@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(page_size=st.sampled_from([2, 4, 8]), prefix=st.booleans(), budget=st.sampled_from([1, 3, 8, 32, 1000]),
       rnd=st.randoms(use_true_random=True), async_scheduling=st.booleans())
def test_random_traffic_keeps_the_cache_consistent(page_size, prefix, budget, rnd, async_scheduling):
    engine, aborted = run_trace(page_size, prefix, budget, rnd, async_scheduling)
    event(f"async scheduling: {async_scheduling}")
    event(f"preempted: {engine.scheduler.num_preemptions > 0}")
    event(f"prefix hit: {engine.cache.hit_tokens > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"steps > 20: {engine.num_steps > 20}")


def test_fixed_traces_cover_preemption_and_prefix_hits():
    """A few fixed traces, so that every run certainly drives preemption, prefix hits and aborts."""
    seen = {"preempted": 0, "hit": 0, "aborted": 0}
    for seed in range(8):
        engine, aborted = run_trace(4 if seed % 2 else 8, True, [3, 1000][seed % 2], random.Random(seed),
                                    async_scheduling=seed % 4 < 2)
        seen["preempted"] += engine.scheduler.num_preemptions > 0
        seen["hit"] += engine.cache.hit_tokens > 0
        seen["aborted"] += bool(aborted)
    assert all(seen.values()), seen


def run_trace(page_size: int, prefix: bool, budget: int, rnd: random.Random, async_scheduling: bool = False):
    """Play a random trace against a fresh engine, checking the invariants after every step and abort and each
    finished request's output at the end; returns the engine and the aborted request ids."""
    pool_tokens, max_seqs = rnd.randint(24, 160), rnd.choice([1, 2, 3, 4, 4, 6, 6])
    snapshots, max_model_len = rnd.choice([0, 2, 6, 16, 48]), rnd.randint(16, 160)
    num_pages = -(-pool_tokens // page_size)
    ops = random_trace(rnd)
    engine = build(page_size, num_pages, max_seqs, budget, prefix, max_model_len, snapshots, async_scheduling)
    capacity = min(num_pages, -(-max_model_len // page_size)) * page_size
    expect: dict[str, tuple] = {}
    aborted: set[str] = set()
    n = 0
    for o in ops:
        if o[0] == "add":
            _, base, shared, extra, max_tokens, sampled = o
            prompt = BASES[base][:shared] + [41 + (n * 7 + i) % 500 for i in range(extra)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8 if sampled else 0.0, seed=n)
            rid = f"q{n}"
            n += 1
            too_long = not prompt or len(prompt) >= max_model_len or len(prompt) + 1 > capacity
            try:
                engine.add_request(prompt, params, request_id=rid)
            except RequestError:
                assert too_long
                continue
            assert not too_long
            expect[rid] = (prompt, params, min(max_model_len, capacity))
        elif o[0] == "step":
            for _ in range(o[1]):
                if engine.has_unfinished():
                    engine.step()
                    check_invariants(engine)
        else:
            live = [r for r, q in engine.requests.items() if q.status != Status.FINISHED]
            if live:
                rid = live[o[1] % len(live)]
                out = engine.abort(rid)
                assert out.finish_reason == "abort"
                aborted.add(rid)
                check_invariants(engine)
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        engine.step()
        check_invariants(engine)
    assert not engine.has_unfinished(), "requests never finished"
    for rid, (prompt, params, max_len) in expect.items():
        req = engine.requests[rid]
        assert req.status == Status.FINISHED
        if rid in aborted:
            assert req.finish_reason == "abort"
            continue
        assert req.finish_reason in ("stop", "length")
        assert req.output_token_ids == expected_output(prompt, params, params.seed, max_len), \
            f"{rid} changed (preempted {req.metrics.preemptions}x, cached {req.metrics.cached_tokens})"
    c = engine.cache
    assert c.used_pages == 0 and c.used_slots == 0 and all(r == 0 for r in c.ref)
    assert len(c.free_pages) + len(c.evictable) == c.num_pages
    return engine, aborted


def test_fake_model_catches_a_wrong_restore():
    """The fake model's checks are live: a snapshot restored into the wrong slot is reported."""
    engine = build(4, 40, 2, 1000, True, 120)
    engine.add_request(BASES[0][:20], SamplingParams(max_tokens=2, temperature=0), request_id="a")
    while engine.has_unfinished():
        engine.step()
    assert engine.cache.snapshot_of_key
    # corrupt every snapshot: a later hit must be caught by the model's state check
    for slot in engine.cache.snapshot_of_key.values():
        engine.cache.pools.recurrent[min(engine.cache.pools.recurrent)][slot, 0, 0, 1] += 1
    engine.add_request(BASES[0][:20], SamplingParams(max_tokens=2, temperature=0), request_id="b")
    try:
        engine.step()
    except AssertionError as e:
        assert "KDA state" in str(e)
    else:
        raise AssertionError("a corrupted snapshot went unnoticed")
