"""The engine on the real (reference) tiny K3 model, fp32, greedy: continuous batching, chunked prefill and
preemption never change a request's tokens; bad requests are refused without disturbing the others; the pool is
empty again afterwards; the step reads persistent input buffers."""

from __future__ import annotations

import pytest
import torch

from test_runtime_helpers import (assert_pool_empty, greedy, make_engine, random_prompts, run_to_end,
                                  solo_tokens, tiny_checkpoint)

from kestrel.errors import RequestError
from kestrel.llm import LLM
from kestrel.sampling_params import SamplingParams

PRESET = "k3-tiny"

# 24 requests: prompt lengths 1..300, max_tokens 1..20; a few share a prefix with an earlier one (prefix hits
# while batched), one prompt is a page-aligned prefix of another.
LENGTHS = [1, 300, 17, 64, 5, 200, 33, 129, 2, 90, 16, 250, 48, 7, 180, 31, 100, 3, 75, 260, 12, 150, 40, 97]
MAX_TOKENS = [12, 5, 20, 1, 9, 14, 3, 18, 7, 11, 2, 16, 6, 19, 4, 13, 8, 17, 10, 15, 1, 20, 5, 9]


def _prompts() -> list[list[int]]:
    ps = random_prompts(1234, LENGTHS)
    ps[9] = ps[5][:70] + ps[9][70:]          # shares 70 tokens with request 5
    ps[16] = ps[1][:100]                     # a prefix of request 1, page aligned (100 = 6 pages + 4)
    ps[21] = ps[5][:150]                     # a prefix of request 5
    return ps


@pytest.fixture(scope="module")
def workload():
    prompts = _prompts()
    return prompts, solo_tokens(PRESET, prompts, MAX_TOKENS)


def _run_staggered(engine, prompts, max_tokens, waves=(0, 6, 6, 12, 20, 24), steps_between=3):
    """Add the requests in waves with a few steps in between; return each request's tokens."""
    rids = []
    for a, b in zip(waves, waves[1:]):
        for i in range(a, b):
            rids.append(engine.add_request(prompts[i], greedy(max_tokens[i]), request_id=f"r{i}"))
        for _ in range(steps_between):
            if engine.has_unfinished():
                engine.step()
    run_to_end(engine)
    return [engine.final_output(r).token_ids for r in rids]


def test_batch_invariance(workload):
    prompts, solo = workload
    engine = make_engine(PRESET, max_num_seqs=16, max_num_batched_tokens=256)
    got = _run_staggered(engine, prompts, MAX_TOKENS)
    for i, (g, s) in enumerate(zip(got, solo)):
        assert len(g) == MAX_TOKENS[i]
        assert g == s, f"request {i} (prompt {LENGTHS[i]} tokens) differs from its solo run"
    # shared prefixes were restored while batched (as far as the 16 LRU snapshot slots kept them)
    assert engine.cache.hit_tokens > 0
    assert sum(engine.requests[f"r{i}"].metrics.cached_tokens for i in range(24)) == engine.cache.hit_tokens
    assert_pool_empty(engine)


@pytest.mark.parametrize("budget", [7, 64, 1 << 20])
def test_chunked_prefill_budgets(workload, budget):
    prompts, solo = workload
    pick = [1, 5, 7, 0, 19, 11]              # 300, 200, 129, 1, 260, 250 tokens
    engine = make_engine(PRESET, max_num_batched_tokens=budget)
    rids = [engine.add_request(prompts[i], greedy(MAX_TOKENS[i])) for i in pick]
    steps_before = engine.num_steps
    run_to_end(engine)
    for i, rid in zip(pick, rids):
        assert engine.final_output(rid).token_ids == solo[i], f"request {i}, budget {budget}"
    if budget == 7:                          # 300 prompt tokens at 7 a step: the prompt really was chunked
        assert engine.num_steps - steps_before >= 300 // 7
    assert_pool_empty(engine)


def test_preemption_keeps_outputs(workload):
    prompts, solo = workload
    pick = [2, 13, 17, 15, 0, 9]             # prompts 1..90 tokens, 11..20 new tokens each
    # 8 pages of 16 tokens: any one request fits alone (<= 101 tokens), all of them together (18 pages) do not
    engine = make_engine(PRESET, kv_cache_tokens=128, max_num_batched_tokens=128)
    rids = [engine.add_request(prompts[i], greedy(MAX_TOKENS[i])) for i in pick]
    run_to_end(engine)
    preempted = [engine.requests[r].metrics.preemptions for r in rids]
    assert sum(preempted) > 0, "the pool was meant to be too small for every request at once"
    assert engine.scheduler.num_preemptions == sum(preempted)
    for i, rid in zip(pick, rids):
        out = engine.final_output(rid)
        assert out.token_ids == solo[i], f"request {i} changed after {out.metrics.preemptions} preemptions"
        assert out.finish_reason == "length"
    assert_pool_empty(engine)


def test_refusals_do_not_disturb_others_and_pool_drains(workload):
    prompts, solo = workload
    engine = make_engine(PRESET, kv_cache_tokens=320, max_model_len=512)
    ok = [engine.add_request(prompts[i], greedy(MAX_TOKENS[i])) for i in (2, 3)]
    engine.step()
    with pytest.raises(RequestError, match="maximum context is 512"):
        engine.add_request(list(range(3, 3 + 600)), greedy(4))
    with pytest.raises(RequestError, match="whole KV cache holds 320"):
        engine.add_request(list(range(3, 3 + 400)), greedy(4))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], greedy(4))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([5, 10 ** 6], greedy(4))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([5], greedy(4), request_id=ok[0])
    # aborts: a running one, a second one (running or still waiting), an unknown id
    victim = engine.add_request(prompts[5], greedy(50))
    waiting = engine.add_request(prompts[7], greedy(50))
    engine.step()
    assert engine.requests[victim].pages, "the victim should be running and hold pages"
    assert engine.abort(victim).finish_reason == "abort"
    assert engine.abort(waiting).finish_reason == "abort"
    assert engine.abort("nobody") is None
    run_to_end(engine)
    for i, rid in zip((2, 3), ok):
        assert engine.final_output(rid).token_ids == solo[i]
    assert engine.final_output(victim).finish_reason == "abort"
    assert_pool_empty(engine)


def test_metrics_and_stop_conditions():
    engine = make_engine(PRESET)
    prompt = random_prompts(7, [40])[0]
    free = engine.add_request(prompt, greedy(12))
    run_to_end(engine)
    toks = engine.final_output(free).token_ids
    # stop on a token id: the output ends right at its first occurrence
    stop_at = toks[4]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))
    run_to_end(engine)
    out = engine.final_output(rid)
    assert out.finish_reason == "stop" and out.token_ids == toks[:toks.index(stop_at) + 1]
    # stop on eos (not ignored): the first eos ends the request
    engine.eos_ids = {toks[2]}
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0))
    run_to_end(engine)
    out = engine.final_output(rid)
    assert out.finish_reason == "stop" and out.token_ids == toks[:toks.index(toks[2]) + 1]
    # stop string: the text ends before it, streamed deltas never show part of it
    engine.eos_ids = set()
    text = engine.final_output(free).text
    assert len(text) >= 12
    stop = text[6:9]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
    deltas = []
    while engine.has_unfinished():
        deltas += [o.delta_text for o in engine.step() if o.request_id == rid]
    out = engine.final_output(rid)
    assert out.finish_reason == "stop" and out.text == text[:text.find(stop)] == "".join(deltas)
    assert len(out.token_ids) < 12 and out.token_ids == toks[:len(out.token_ids)]
    # metrics of the free-running one
    m = engine.final_output(free).metrics
    assert m.prompt_tokens == 40 and m.generated_tokens == 12 and m.cached_tokens == 0 and m.preemptions == 0
    assert m.arrival <= m.first_scheduled <= m.first_token <= m.finished
    assert m.time_to_first_token >= 0 and m.latency >= m.time_to_first_token
    # the second run of the same prompt was served from the prefix cache
    assert engine.requests[rid].metrics.cached_tokens == 32
    assert engine.cache.hit_rate() > 0


def test_llm_generate_runs_on_the_engine(workload):
    prompts, solo = workload
    llm = LLM(model=tiny_checkpoint(PRESET), dtype="float32", device="cpu",
              page_size=16, kv_cache_tokens=4096)
    outs = llm.generate([prompts[2], prompts[6]], [greedy(MAX_TOKENS[2]), greedy(MAX_TOKENS[6])])
    assert [o.token_ids for o in outs] == [solo[2], solo[6]]
    assert all(o.finish_reason == "length" for o in outs)
    assert not llm.engine.requests                       # bookkeeping released
    assert_pool_empty(llm.engine)
    with pytest.raises(RequestError, match="prompt 1"):
        llm.generate([prompts[2], []], greedy(3))
    assert_pool_empty(llm.engine)


def test_step_reads_persistent_input_buffers():
    engine = make_engine(PRESET, max_num_seqs=8)
    buffers = engine.inputs
    cache = engine.cache
    seen = []
    model = engine.runner.model

    def spy(batch, pools):
        seen.append(batch)
        assert batch.block_tables.shape[1] == cache.max_pages_per_seq
        live = batch.num_reqs - batch.padded_rows
        for b in range(batch.num_reqs):     # each segment's block-table row is its request's pages
            slot = int(batch.slots[b])
            row = batch.block_tables[b].tolist()
            if b >= live:                   # decode padding: the scratch slot and the scratch page only
                assert slot == cache.scratch_slot and set(row) == {cache.scratch_page}
                continue
            req = next(r for r in engine.scheduler.running if r.slot == slot)
            assert row[:len(req.pages)] == req.pages and set(row[len(req.pages):]) <= {-1}
        return model(batch, pools)

    engine.runner.model = spy
    table = cache.block_tables
    for p in random_prompts(3, [20, 35, 3]):
        engine.add_request(p, greedy(8))
    run_to_end(engine)
    assert engine.cache.block_tables is table
    decode = [b for b in seen if all(b.seq_len(i) == 1 for i in range(b.num_reqs))]
    assert len(decode) >= 5
    assert any(b.padded_rows for b in decode)            # 3 requests pad to the bucket of 4
    decode_ids = {id(b) for b in decode}
    for b in seen:
        if id(b) in decode_ids:         # the static decode buffers, one set per bucket
            n = b.num_reqs
            assert n in engine.runner.buckets
            assert b.token_ids.data_ptr() == buffers.dec.data_ptr()
            assert b.positions.data_ptr() == buffers.dec[1].data_ptr()
            assert b.slots.data_ptr() == buffers.dec[2].data_ptr()
            assert b.block_tables.data_ptr() == buffers.dec_tables.data_ptr()
            assert b.logits_indices.data_ptr() == buffers.arange64.data_ptr()
            assert b.cu_seqlens_dev.tolist() == list(range(n + 1)) == b.cu_seqlens
            continue
        assert b.token_ids.data_ptr() == buffers.token_ids.data_ptr()
        assert b.positions.data_ptr() == buffers.positions.data_ptr()
        assert b.slots.data_ptr() == buffers.slots.data_ptr()
        assert b.block_tables.data_ptr() == buffers.block_tables.data_ptr()
        assert b.logits_indices.data_ptr() == buffers.logits_indices.data_ptr()
        assert b.cu_seqlens_dev.tolist() == b.cu_seqlens
        lens = [b.seq_len(i) for i in range(b.num_reqs)]
        assert b.req_idx.tolist() == [i for i, n in enumerate(lens) for _ in range(n)]
        assert b.cu_kv_dev.tolist()[1:] == torch.tensor([c + n for c, n in zip(b.context_lens, lens)]).cumsum(0).tolist()
    assert buffers.token_ids.shape[0] >= 8 and buffers.slots.shape[0] >= 8


def test_oversized_step_still_runs():
    """A prefill larger than the persistent buffers gets one-off tensors and the same answer."""
    prompt = random_prompts(11, [120])[0]
    ref = solo_tokens(PRESET, [prompt], [4])[0]
    engine = make_engine(PRESET, max_num_seqs=2, max_num_batched_tokens=1 << 20)
    engine.inputs.token_capacity = 64          # pretend the buffers are small
    rid = engine.add_request(prompt, greedy(4))
    run_to_end(engine)
    assert engine.final_output(rid).token_ids == ref
    assert engine.inputs.oversize_steps >= 1
    assert torch.equal(engine.cache.block_tables, engine.cache.block_tables_host)
