"""Prefix caching: a hit shares the MLA pages, restores the KDA state snapshot, and gives exactly the tokens of a
cold run (prefix caching off), also when the shared prefix ends inside a page and under chunked prefill; unused
pages and snapshots are evicted least recently used first."""

from __future__ import annotations

import functools

import pytest
import torch

from test_runtime_helpers import assert_pool_empty, greedy, make_engine, random_prompts, run_to_end, solo_tokens

PS = 16
PREFIX = random_prompts(99, [200])[0]                     # ends inside page 12 (200 = 12 * 16 + 8)
A = PREFIX + random_prompts(100, [40])[0]
B = PREFIX + random_prompts(101, [30])[0]
C = A[:100]                                              # a strict prefix of A, ending inside page 6
D = A[:208]                                              # 13 whole pages: the last one must be computed
N_A, N_OTHER = 30, 8


@functools.lru_cache(maxsize=None)
def cold(preset: str) -> dict[str, list[int]]:
    toks = solo_tokens(preset, [A, B, C, D], [N_A, N_OTHER, N_OTHER, N_OTHER])
    return dict(zip("ABCD", toks))


def _kda_state(engine, slot: int) -> list[torch.Tensor]:
    pools = engine.cache.pools
    return [pools.conv[i][slot].clone() for i in sorted(pools.conv)] + \
           [pools.recurrent[i][slot].clone() for i in sorted(pools.recurrent)]


def _cold_state_after(preset: str, tokens: list[int]) -> list[torch.Tensor]:
    """KDA state of a cold engine (no prefix cache) right after reading `tokens` in one step."""
    engine = make_engine(preset, enable_prefix_caching=False, max_num_batched_tokens=len(tokens))
    rid = engine.add_request(tokens + [7], greedy(1))
    engine.step()
    req = engine.requests[rid]
    assert req.num_computed == len(tokens)
    return _kda_state(engine, req.slot)


@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])
@pytest.mark.parametrize("budget", [2048, 7])
def test_prefix_hit_is_exact(preset, budget):
    ref = cold(preset)
    engine = make_engine(preset, max_num_batched_tokens=budget, page_size=PS)
    ra = engine.add_request(A, greedy(N_A), request_id="A")
    req_a = engine.requests[ra]
    while req_a.num_computed < len(A):
        engine.step()
    assert req_a.committed_pages == len(A) // PS

    # B arrives while A still runs: the spy records B's KDA state as the step that admits it starts
    restored = {}
    model = engine.runner.model

    def spy(batch, pools):
        req_b = engine.requests.get("B")
        if req_b is not None and req_b.slot is not None and "state" not in restored:
            restored["state"] = _kda_state(engine, req_b.slot)
            restored["pages"] = list(req_b.pages)
            restored["refs"] = [engine.cache.ref[p] for p in req_b.pages]
            restored["snapshot"] = _kda_state(engine, engine.cache.snapshot_of_key[req_b.page_hashes[11]])
        return model(batch, pools)

    engine.runner.model = spy
    engine.add_request(B, greedy(N_OTHER), request_id="B")
    engine.step()
    req_b = engine.requests["B"]
    hit = 12 * PS
    assert req_b.metrics.cached_tokens == hit
    assert engine.cache.hit_tokens == hit
    assert restored["pages"][:12] == req_a.pages[:12], "the shared prefix must reuse A's pages, not copies"
    assert restored["refs"] == [2] * 12 + [1] * (len(restored["pages"]) - 12)
    assert not set(restored["pages"][12:]) & set(req_a.pages), "B writes its own tail pages"
    # B's slot holds the snapshot A left at token 192, bit for bit, and that is the state a cold run reaches
    # there (up to the rounding of A's chunking: different GEMM shapes)
    for got, snap in zip(restored["state"], restored["snapshot"]):
        assert torch.equal(got, snap)
    want = _cold_state_after(preset, PREFIX[:hit])
    for got, exp in zip(restored["state"], want):
        assert got.abs().max() > 0
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=2e-5)
    engine.runner.model = model

    # C: a strict prefix of A ending inside a page; D: page-aligned, so its last page is recomputed
    engine.add_request(C, greedy(N_OTHER), request_id="C")
    engine.add_request(D, greedy(N_OTHER), request_id="D")
    run_to_end(engine)
    assert engine.requests["C"].metrics.cached_tokens == 6 * PS
    assert engine.requests["D"].metrics.cached_tokens == 12 * PS
    for name in "ABCD":
        assert engine.final_output(name).token_ids == ref[name], f"request {name} differs from the cold run"
    assert engine.cache.hit_rate() == engine.cache.hit_tokens / (len(A) + len(B) + len(C) + len(D))
    assert_pool_empty(engine)

    # the same prompt again, after A finished: its pages are cached (unreferenced) and are found again
    again = engine.add_request(A, greedy(N_OTHER))
    run_to_end(engine)
    assert engine.requests[again].metrics.cached_tokens == (len(A) - 1) // PS * PS
    assert engine.final_output(again).token_ids == ref["A"][:N_OTHER]


def test_lru_eviction_of_pages_and_snapshots():
    preset = "kimi-linear-tiny"
    prompts = random_prompts(7, [60, 60, 60])
    ref = solo_tokens(preset, prompts, [4, 4, 4])
    # 12 pages, 2 request slots + 2 snapshot slots: each prompt leaves 3 cached pages and wants 3 snapshots
    engine = make_engine(preset, kv_cache_tokens=12 * PS, max_num_seqs=2)
    outs = []
    for p in prompts:
        rid = engine.add_request(p, greedy(4))
        run_to_end(engine)
        outs.append(engine.final_output(rid).token_ids)
    assert outs == ref
    assert engine.cache.evicted_snapshots > 0
    # the newest prompt is still cached; the oldest one lost its snapshots and is recomputed cold
    newest = engine.add_request(prompts[2], greedy(4))
    run_to_end(engine)
    oldest = engine.add_request(prompts[0], greedy(4))
    run_to_end(engine)
    assert engine.requests[newest].metrics.cached_tokens == 48
    assert engine.requests[oldest].metrics.cached_tokens == 0
    assert engine.final_output(newest).token_ids == ref[2] and engine.final_output(oldest).token_ids == ref[0]
    # fill the pool with fresh work: unreferenced cached pages are evicted to make room, never refused
    big = random_prompts(8, [150])[0]
    rid = engine.add_request(big, greedy(4))
    run_to_end(engine)
    assert engine.final_output(rid).token_ids == solo_tokens(preset, [big], [4])[0]
    assert engine.cache.evicted_pages > 0
    assert_pool_empty(engine)


def test_prefix_caching_off_never_hits():
    preset = "kimi-linear-tiny"
    engine = make_engine(preset, enable_prefix_caching=False)
    for _ in range(2):
        rid = engine.add_request(A, greedy(2))
        run_to_end(engine)
        assert engine.requests[rid].metrics.cached_tokens == 0
    assert engine.cache.hit_tokens == 0 and not engine.cache.page_of_key and not engine.cache.snapshot_of_key
    assert engine.cache.num_snapshots == 0


def test_failed_step_leaves_no_stale_snapshot():
    """Snapshot slots are promised when the batch is built; if the model step fails they hold garbage and must not
    be found by a later request."""
    preset = "kimi-linear-tiny"
    engine = make_engine(preset)
    model = engine.runner.model

    def broken(batch, pools):
        assert batch.snapshots, "the prompt should have asked for snapshots"
        raise RuntimeError("device lost")

    engine.runner.model = broken
    rid = engine.add_request(A, greedy(2))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert not engine.cache.snapshot_of_key
    assert len(engine.cache.free_snapshots) == engine.cache.num_snapshots
    assert engine.abort(rid).finish_reason == "abort"
    assert_pool_empty(engine)
    engine.runner.model = model
    again = engine.add_request(A, greedy(N_OTHER))
    run_to_end(engine)
    assert engine.requests[again].metrics.cached_tokens == 0
    assert engine.final_output(again).token_ids == cold(preset)["A"][:N_OTHER]
