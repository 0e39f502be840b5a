"""Speculative decoding in the engine on the tiny K3 reference model (fp32, CPU): greedy output with speculation
equals greedy output without it, token for token, across batch sizes, chunked prefill, preemption and prefix-cache
hits; pages of rejected drafts go back; one KDA slot per request; stop conditions inside an accepted run; seeded
sampling the same alone or batched; the policy, the config flag, /metrics and the bench output."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from test_runtime_helpers import (assert_pool_empty, greedy, make_engine, random_prompts, run_to_end,
                                  solo_tokens, tiny_checkpoint)

from kestrel.config import EngineConfig, SpeculativeConfig
from kestrel.errors import ConfigError
from kestrel.sampling_params import SamplingParams
from kestrel.spec.proposer import DraftBlock, Proposer

PRESET = "k3-tiny"
K = 4
ENFORCED = {"method": "ngram", "num_speculative_tokens": K, "enforce": True}
LENGTHS = [40, 3, 130, 17, 64, 90, 1, 33]
MAX_TOKENS = [14, 9, 6, 20, 11, 17, 8, 13]


def _prompts() -> list[list[int]]:
    ps = random_prompts(77, LENGTHS)
    ps[5] = ps[2][:70] + ps[5][70:]          # shares 70 tokens (4 pages of 16) with request 2: a prefix hit
    return ps


@pytest.fixture(scope="module")
def workload():
    prompts = _prompts()
    return prompts, solo_tokens(PRESET, prompts, MAX_TOKENS)


class DeviceOnly(torch.Tensor):
    """A draft block's tokens that the engine may compute with but not read on the host (a DSpark-style block of K
    drafts a row stays on the device: reading it would make the host wait for the propose before the verify)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.cpu,
                    torch.Tensor.__iter__, torch.Tensor.__bool__, torch.Tensor.__int__):
            raise AssertionError(f"the engine read the drafts on the host ({func.__name__})")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class Oracle(Proposer):
    """Drafts from the known greedy continuation, each right with probability `p_right` (wrong from the first miss
    on), so blocks are accepted in full, in part and not at all; deterministic per (request, position). Its tokens
    are `DeviceOnly`."""
    method = "oracle"

    def __init__(self, prompts, outputs, k: int = K, p_right: float = 0.75):
        self.num_tokens, self.p_right = k, p_right
        self.truth = [list(p) + list(o) for p, o in zip(prompts, outputs)]
        self.calls = 0

    def propose(self, inputs, block_tables, pools) -> DraftBlock:
        self.calls += 1
        rows = []
        for x in inputs:
            ids = list(x.token_ids)
            truth = next((t for t in self.truth if t[:len(ids)] == ids), ids)     # unknown prompt: junk drafts
            rng = random.Random(len(ids) * 7919 + ids[0])
            nxt = truth[len(ids):len(ids) + self.num_tokens]
            nxt += [3] * (self.num_tokens - len(nxt))
            miss = next((j for j in range(self.num_tokens) if rng.random() > self.p_right), self.num_tokens)
            rows.append([t if j < miss else (t + 1) % 1000 for j, t in enumerate(nxt)])
        return DraftBlock(torch.tensor(rows).as_subclass(DeviceOnly))


def _checked_run(engine, prompts, max_tokens, params=None) -> list[list[int]]:
    """Run every request to the end, checking after each step that a request holds pages for its computed tokens
    only (rejected drafts' pages went back) and one KDA slot."""
    ps = engine.cache.page_size
    rids = [engine.add_request(p, params or greedy(n)) for p, n in zip(prompts, max_tokens)]
    for _ in range(10000):
        if not engine.has_unfinished():
            break
        engine.step()
        running = engine.scheduler.running
        assert engine.cache.used_slots == len(running)
        for r in running:
            assert len(r.pages) == math.ceil(r.num_computed / ps), (r.request_id, len(r.pages), r.num_computed)
    outs = [list(engine.final_output(r).token_ids) for r in rids]
    for r in rids:
        engine.release(r)
    return outs


@pytest.mark.parametrize("setup", [dict(max_num_seqs=1), dict(max_num_seqs=4, max_num_batched_tokens=7),
                                   dict(max_num_seqs=16), dict(kv_cache_tokens=144, max_num_batched_tokens=32)],
                         ids=["batch1", "chunked", "batch16", "preempt"])
def test_greedy_oracle_speculation_equals_plain(workload, setup):
    prompts, solo = workload
    engine = make_engine(PRESET, speculative_config=ENFORCED, **setup)
    engine.proposer = Oracle(prompts, solo)
    # a prefix-cache hit: request 5 shares its first 64 tokens (pages and the KDA snapshot) with this one
    _checked_run(engine, [prompts[2][:66]], [3])
    assert _checked_run(engine, [prompts[5]], [MAX_TOKENS[5]]) == [solo[5]]
    assert engine.cache.hit_tokens == 64
    got = _checked_run(engine, prompts, MAX_TOKENS)
    for i, (g, s) in enumerate(zip(got, solo)):
        assert g == s, f"request {i} differs with speculation ({setup})"
    st = engine.stats()["spec"]
    assert st["verify_blocks"] > 0 and 0 < st["accepted_tokens"] < st["draft_tokens"]
    hist = st["accept_len_hist"]
    assert hist["1"] > 0 and hist[str(K + 1)] > 0            # blocks rejected at once and accepted in full
    if "kv_cache_tokens" in setup:
        assert engine.scheduler.num_preemptions > 0
    assert_pool_empty(engine)


@pytest.mark.parametrize("setup", [dict(max_num_seqs=8), dict(max_num_seqs=3, max_num_batched_tokens=16)],
                         ids=["batch8", "chunked"])
def test_greedy_ngram_speculation_equals_plain(workload, setup):
    prompts, solo = workload
    # a random model's continuations rarely repeat its prompt: single-token matches make the proposer speak
    engine = make_engine(PRESET, speculative_config={**ENFORCED, "prompt_lookup_min": 1}, **setup)
    got = _checked_run(engine, prompts, MAX_TOKENS)
    assert got == solo
    assert engine.stats()["spec"]["verify_blocks"] > 0
    assert_pool_empty(engine)


def test_one_kda_slot_per_request():
    """Speculation allocates no state slots of its own: the pools are the plain engine's, slot for slot."""
    plain = make_engine(PRESET, max_num_seqs=4)
    spec = make_engine(PRESET, max_num_seqs=4, speculative_config=ENFORCED)
    assert spec.cache.num_slots == plain.cache.num_slots == 4
    assert {i: t.shape for i, t in spec.cache.pools.recurrent.items()} == \
        {i: t.shape for i, t in plain.cache.pools.recurrent.items()}
    assert spec.cache.nbytes() == plain.cache.nbytes()


def test_stop_conditions_inside_an_accepted_run(workload):
    prompts, solo = workload
    i = 3                                                    # 20 tokens
    toks = solo[i]
    engine = make_engine(PRESET, speculative_config=ENFORCED)
    engine.proposer = Oracle(prompts, solo, p_right=1.0)     # every block accepted in full
    stop_at = toks[6]
    rid = engine.add_request(prompts[i], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))
    run_to_end(engine)
    out = engine.final_output(rid)
    assert out.finish_reason == "stop" and list(out.token_ids) == toks[:toks.index(stop_at) + 1]
    engine.eos_ids = {toks[9]}
    rid = engine.add_request(prompts[i], SamplingParams(max_tokens=20, temperature=0))
    run_to_end(engine)
    assert list(engine.final_output(rid).token_ids) == toks[:toks.index(toks[9]) + 1]
    engine.eos_ids = set()
    rid = engine.add_request(prompts[i], greedy(7))           # max_tokens not a multiple of K + 1
    run_to_end(engine)
    out = engine.final_output(rid)
    assert out.finish_reason == "length" and list(out.token_ids) == toks[:7]
    # a stop string: the same text as without speculation
    text = engine.final_output(rid).text
    stop = text[3:6]
    plain = make_engine(PRESET)
    res = []
    for e in (engine, plain):
        r = e.add_request(prompts[i], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))
        run_to_end(e)
        res.append((e.final_output(r).text, list(e.final_output(r).token_ids)))
    assert res[0] == res[1] and stop not in res[0][0]
    assert_pool_empty(engine)


def test_seeded_sampling_same_alone_or_batched(workload):
    prompts, solo = workload
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=1234, ignore_eos=True)
    engine = make_engine(PRESET, speculative_config=ENFORCED)
    engine.proposer = Oracle(prompts, solo)
    alone = _checked_run(engine, [prompts[0]], [12], params)[0]
    others = [SamplingParams(max_tokens=9, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts[1:4], others)]
    rid = engine.add_request(prompts[0], params)
    run_to_end(engine)
    assert list(engine.final_output(rid).token_ids) == alone
    assert engine.stats()["spec"]["verify_blocks"] > 0
    for r in rids:
        engine.release(r)


def test_policy_turns_speculation_off_where_it_loses(workload):
    """Above disable_by_batch_size nothing speculates; a proposer that is always wrong gets switched off once the
    measured break-even says a block costs more than the one token it yields."""
    prompts, solo = workload
    engine = make_engine(PRESET, speculative_config={**ENFORCED, "enforce": False, "disable_by_batch_size": 2})
    engine.proposer = Oracle(prompts, solo)
    _checked_run(engine, prompts[:4], [8] * 4)
    assert engine.stats()["spec"]["verify_blocks"] == 0       # 4 decoding requests > 2: off
    engine = make_engine(PRESET, speculative_config={**ENFORCED, "enforce": False})
    engine.proposer = Oracle(prompts, solo, p_right=0.0)
    pol = engine.policy
    got = _checked_run(engine, [prompts[0]], [40])
    assert got[0][:len(solo[0])] == solo[0]
    st = engine.stats()["spec"]
    assert st["accepted_tokens"] == 0
    if (pol.break_even(1) or 0) > 1:                          # a verify step costs more than a decode step here
        assert st["verify_steps"] < st["decode_steps"]


def test_speculative_config_errors(tmp_path):
    def bad(value, match):
        with pytest.raises(ConfigError, match=match) as e:
            EngineConfig(model="x", speculative_config=value)
        assert "\n" not in str(e.value)

    bad("{nope", "not valid JSON")
    bad('{"method": "medusa", "num_speculative_tokens": 3}', "method 'medusa' is not supported")
    bad({"method": "ngram"}, "num_speculative_tokens is missing")
    bad({"method": "ngram", "num_speculative_tokens": 0}, "must be an integer 1..16")
    bad({"method": "ngram", "num_speculative_tokens": 99}, "must be an integer 1..16")
    bad({"method": "ngram", "num_speculative_tokens": True}, "must be an integer")
    bad({"method": "dspark", "num_speculative_tokens": 7}, "needs \"model\"")
    bad({"method": "dspark", "num_speculative_tokens": 7, "model": str(tmp_path / "none")}, "no such directory")
    bad({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 9}, "prompt_lookup_min")
    bad({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown field 'k'")
    bad({"method": "ngram", "num_speculative_tokens": 2, "enforce": "yes"}, "enforce")
    bad([1, 2], "JSON object")
    with pytest.raises(ConfigError, match="one rank"):
        EngineConfig(model="x", tensor_parallel_size=2, speculative_config={"method": "ngram",
                                                                            "num_speculative_tokens": 2})
    ok = EngineConfig(model="x", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert ok.speculative_config == SpeculativeConfig("ngram", 3)
    assert EngineConfig(model="x", speculative_config="").speculative_config is None
    d = EngineConfig(model="x", speculative_config={"method": "dspark", "model": str(tmp_path),
                                                    "num_speculative_tokens": 7}).speculative_config
    assert d.method == "dspark" and d.model == str(tmp_path) and d.num_speculative_tokens == 7


def test_llm_and_cli_take_the_flag(workload):
    prompts, solo = workload
    from kestrel.cli import build_parser, engine_config
    from kestrel.llm import LLM
    llm = LLM(model=tiny_checkpoint(PRESET), dtype="float32", device="cpu", page_size=16, kv_cache_tokens=4096,
              speculative_config=ENFORCED)
    assert llm.engine.proposer.method == "ngram" and llm.engine.policy is not None
    out = llm.generate([prompts[4]], greedy(MAX_TOKENS[4]))[0]
    assert list(out.token_ids) == solo[4]
    args = build_parser().parse_args(["generate", "--model", tiny_checkpoint(PRESET), "--speculative-config",
                                      json.dumps(ENFORCED), "hi"])
    assert engine_config(args).speculative_config.num_speculative_tokens == K
    args = build_parser().parse_args(["generate", "--model", tiny_checkpoint(PRESET), "--speculative-config",
                                      '{"method": "x"}', "hi"])
    with pytest.raises(ConfigError, match="method 'x'"):
        engine_config(args)


def test_metrics_and_bench_report_speculation(workload):
    prompts, solo = workload
    from kestrel.bench.latency import format_table as latency_table
    from kestrel.bench.latency import run_latency
    from kestrel.serve.metrics import ServerMetrics, metric, parse_prometheus
    engine = make_engine(PRESET, speculative_config=ENFORCED)
    engine.proposer = Oracle(prompts, solo)
    _checked_run(engine, prompts[:3], MAX_TOKENS[:3])
    st = engine.stats()["spec"]
    page = parse_prometheus(ServerMetrics("m").render(engine.stats(), engine.cache.num_pages, engine.cache.num_slots))
    assert metric(page, "spec_accepted_tokens_total") == st["accepted_tokens"] > 0
    assert metric(page, "spec_draft_tokens_total") == st["draft_tokens"]
    assert metric(page, "spec_acceptance_length_count") == st["verify_blocks"]
    assert metric(page, "spec_acceptance_length_bucket", le=str(K + 1)) == st["verify_blocks"]
    assert metric(page, "spec_verify_seconds_total") > 0
    assert metric(page, "spec_accepted_tokens_per_step") == pytest.approx(st["accepted_per_step"])
    # the latency bench: an oracle that knows no continuation of random prompts drafts junk; the record says so
    report = run_latency(engine, 2, 8, 6, num_iters=1, num_iters_warmup=0)
    dec = report["records"][0]
    assert dec["num_speculative_tokens"] == K and dec["accept_len"] >= 1.0
    assert "speculation (K=4)" in latency_table(report)


def test_dspark_method_loads_the_drafter_through_its_loader(monkeypatch, tmp_path):
    """method dspark: the engine builds its proposer with kestrel.spec.dspark.load_dspark_proposer(model_dir,
    target_config, device, dtype, K) and plans the drafter's layers into the cache pools."""
    dspark = pytest.importorskip("kestrel.spec.dspark")
    seen = {}

    class Fake(Proposer):
        method, num_tokens, extra_layers = "dspark", 3, ()

        def propose(self, inputs, block_tables, pools):
            return DraftBlock(torch.zeros(len(inputs), 3, dtype=torch.long), lengths=[0] * len(inputs))

    def load(model_dir, target_config, device, dtype, num_tokens):
        seen.update(model_dir=model_dir, layers=target_config.num_layers, device=str(device), dtype=dtype, k=num_tokens)
        return Fake()

    monkeypatch.setattr(dspark, "load_dspark_proposer", load)
    engine = make_engine(PRESET, speculative_config={"method": "dspark", "model": str(tmp_path),
                                                     "num_speculative_tokens": 3})
    assert seen == dict(model_dir=str(tmp_path), layers=engine.config.num_layers, device="cpu",
                        dtype=torch.float32, k=3)
    assert isinstance(engine.proposer, Fake)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_speculation_equals_plain(workload):
    """On a GPU: greedy with speculation equals greedy without it (the reference model in fp32)."""
    prompts, _ = workload
    kw = dict(device="cuda", max_num_seqs=8)
    plain = make_engine(PRESET, **kw)
    base = _checked_run(plain, prompts[:4], MAX_TOKENS[:4])
    spec = make_engine(PRESET, speculative_config=ENFORCED, **kw)
    spec.proposer = Oracle(prompts, base)
    assert _checked_run(spec, prompts[:4], MAX_TOKENS[:4]) == base
    assert spec.stats()["spec"]["accepted_tokens"] > 0


def test_decode_and_full_verify_steps_take_the_graph_path(workload):
    """With speculation on, a step without verify blocks is still a padded decode-bucket batch (what a CUDA graph
    replays), and a step whose every request verifies K drafts a padded verify-bucket batch; a verify step with a
    shorter block (the last tokens before max_tokens) is a general batch, run eagerly."""
    prompts, solo = workload
    engine = make_engine(PRESET, max_num_seqs=4, speculative_config={**ENFORCED, "enforce": False,
                                                                     "disable_by_batch_size": 2})
    engine.proposer = Oracle(prompts, solo)
    runner, kinds = engine.runner, []
    model = runner.model

    def spy(batch, pools):
        decoding = all(batch.seq_len(b) == 1 for b in range(batch.num_reqs))
        kinds.append(("verify" if batch.verify_segments else "decode" if decoding else "prefill",
                      runner.is_verify_bucket(batch) if batch.verify_segments else runner.is_decode_bucket(batch)))
        return model(batch, pools)

    runner.model = spy
    runner.commit_verify = lambda accepted: model.commit_verify(accepted, engine.cache.pools)
    _checked_run(engine, prompts[:3], [6, 6, 6])            # 3 decoding > 2: plain decode steps
    _checked_run(engine, prompts[:1], [10])                  # 1 decoding: verify steps
    assert ("decode", True) in kinds and ("verify", True) in kinds and ("verify", False) in kinds
    assert all(bucket for kind, bucket in kinds if kind == "decode")


def test_dspark_drafter_through_the_engine(workload, tmp_path):
    """A (random, untrained) DSpark drafter end to end: its KV pages in the shared pools, observe after every step,
    K drafts a step; greedy output is still the target's token for token, sampled requests take its q."""
    from kestrel.config import ModelConfig
    from kestrel.spec.dspark_checkpoint import write_random_drafter
    from kestrel.spec.dspark_config import tiny_config
    prompts, solo = workload
    config = ModelConfig.from_dir(tiny_checkpoint(PRESET))
    drafter = write_random_drafter(str(tmp_path / "drafter"), tiny_config(config, block_size=K), config, seed=5)
    engine = make_engine(PRESET, max_num_seqs=4, speculative_config={"method": "dspark", "model": drafter,
                                                                     "num_speculative_tokens": K, "enforce": True})
    assert engine.proposer.method == "dspark" and set(engine.proposer.extra_layers) <= set(engine.cache.pools.mla)
    got = _checked_run(engine, prompts[:4], MAX_TOKENS[:4])
    assert got == solo[:4]
    assert engine.stats()["spec"]["verify_blocks"] > 0
    sampled = _checked_run(engine, prompts[:2], [6, 6], SamplingParams(max_tokens=6, temperature=0.9, seed=3,
                                                                       ignore_eos=True))
    assert all(len(t) == 6 for t in sampled)
    assert_pool_empty(engine)
