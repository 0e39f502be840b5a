"""The DSpark drafter: checkpoint names and checks, draft KV in the shared pools and the memory plan, the hidden
capture it reads, and observe / propose on a tiny target (K tokens per request, independent of the batch)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import read_tensors, scratch_dir, single_thread, write_tensors  # noqa: F401
from kestrel.config import EngineConfig, ModelConfig
from kestrel.errors import CheckpointError, ConfigError
from kestrel.models.kimi.checkpoint import preset_config, random_reference_model
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.memory import plan_cache
from kestrel.runtime.request import Request
from kestrel.sampling_params import SamplingParams
from kestrel.spec.dspark import DSparkProposer, load_dspark_proposer
from kestrel.spec.dspark_checkpoint import expected_tensors, random_drafter, write_random_drafter
from kestrel.spec.dspark_config import DSparkConfig, tiny_config
from kestrel.spec.proposer import DraftInput
from kestrel.spec.train import TargetRunner, random_prompts

K = 4


@pytest.fixture(scope="module")
def target():
    config = ModelConfig.from_dict(preset_config("k3-tiny"))
    return config, random_reference_model(config, torch.float32, torch.device("cpu"), seed=3)


@pytest.fixture(scope="module")
def drafter_dir(target):
    config, _ = target
    return write_random_drafter(scratch_dir("drafter"), tiny_config(config, block_size=K), config, seed=5)


# ---- checkpoint ------------------------------------------------------------------------------------------------

def test_names_follow_the_public_k3_drafter(target):
    config, _ = target
    names = expected_tensors(tiny_config(config), config)
    for n in ("context_proj.weight", "context_norm.weight", "final_norm.weight", "markov_head.markov_w1.weight",
              "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias",
              "layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight",
              "layers.0.self_attn.kv_a_layernorm.weight", "layers.0.self_attn.kv_b_proj.weight",
              "layers.0.mlp.gate_proj.weight", "layers.0.input_layernorm.weight"):
        assert n in names, n
    assert "layers.0.self_attn.g_proj.weight" not in names          # vLLM's K3 drafter has no output gate
    from dataclasses import replace
    assert "layers.0.self_attn.g_proj.weight" in expected_tensors(replace(tiny_config(config),
                                                                          mla_use_output_gate=True), config)
    dc = tiny_config(config)
    assert names["context_proj.weight"] == (config.hidden_size, config.hidden_size * len(dc.target_layer_ids))
    assert names["markov_head.markov_w2.weight"] == (config.vocab_size, dc.markov_rank)


def test_load_round_trip_and_skips_target_copies(target, drafter_dir):
    config, model = target
    tensors = read_tensors(drafter_dir)
    d = scratch_dir("drafter-prefixed")
    # a `model.` prefix and copies of the target's embedding / LM head (DeepSpec writes them) are accepted
    write_tensors(d, {"model." + k: v for k, v in tensors.items()} | {"embed_tokens.weight": model.embed_tokens},
                  index=False)
    with open(os.path.join(drafter_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    p = load_dspark_proposer(d, config, "cpu", torch.float32, K, target=model)
    want = random_drafter(tiny_config(config, block_size=K), config, seed=5)
    for (n, a), (_, b) in zip(p.drafter.named_parameters(), want.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("layers.0.self_attn.kv_b_proj.weight"), "layers.0.self_attn.kv_b_proj.weight is missing"),
    (lambda t: t.update({"context_proj.weight": t["context_proj.weight"][:, :-1]}),
     r"context_proj.weight has shape \[64, 191\]"),
    (lambda t: t.update({"layers.1.mlp.up_proj.weight": t["layers.0.mlp.up_proj.weight"].clone()}),
     "layers.1.mlp.up_proj.weight is not part of a DSpark drafter"),
])
def test_loader_names_the_bad_tensor(target, drafter_dir, edit, match):
    config, _ = target
    tensors = read_tensors(drafter_dir)
    edit(tensors)
    d = scratch_dir("drafter-bad")
    write_tensors(d, tensors, num_shards=2)
    with open(os.path.join(drafter_dir, "config.json")) as f, open(os.path.join(d, "config.json"), "w") as g:
        g.write(f.read())
    with pytest.raises(CheckpointError, match=match):
        load_dspark_proposer(d, config, "cpu", torch.float32, K)


def test_config_errors_are_one_line(target):
    config, _ = target
    raw = tiny_config(config).to_dict()
    with pytest.raises(ConfigError, match="missing field `target_layer_ids`"):
        DSparkConfig.from_dict({k: v for k, v in raw.items() if k != "target_layer_ids"})
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        DSparkConfig.from_dict(dict(raw, draft_vocab_size=10))
    other = ModelConfig.from_dict(preset_config("kimi-linear-tiny", layers=2))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        DSparkConfig.from_dict(raw).check_target(other)
    assert DSparkConfig.from_dict(raw) == tiny_config(config)


# ---- the shared cache ------------------------------------------------------------------------------------------

def test_memory_plan_counts_and_logs_the_draft_kv(target, drafter_dir):
    config, _ = target
    p = load_dspark_proposer(drafter_dir, config, "cpu", torch.float32, K)
    assert p.extra_layers == tuple(range(config.num_layers, config.num_layers + 1))
    ec = EngineConfig(model="x", page_size=16, max_num_seqs=4, kv_cache_bytes=4 << 20)
    plain = plan_cache(config, ec, torch.float32, torch.device("cpu"), max_model_len=512)
    draft = plan_cache(config, ec, torch.float32, torch.device("cpu"), max_model_len=512, extra_mla=p.extra_mla)
    width = p.dc.mla_cache_width
    assert draft.draft_bytes_per_page == 16 * width * 4
    assert draft.bytes_per_page == plain.bytes_per_page + draft.draft_bytes_per_page
    assert draft.num_pages < plain.num_pages and draft.nbytes <= 4 << 20       # one budget
    assert "draft KV" in draft.describe(config) and "draft KV" not in plain.describe(config)
    cache = HybridCache(config, draft.num_pages, 16, 4, 4, draft.max_pages_per_seq, torch.float32,
                        torch.device("cpu"), extra_mla=p.extra_mla)
    assert cache.nbytes() == draft.nbytes                       # the plan is what the pools allocate
    assert cache.pools.mla[config.num_layers].shape == (draft.num_pages + 1, 16, width)
    assert config.num_layers in cache.layout()["mla_layers"]    # a peer's handshake sees the draft layer


def test_draft_pages_are_the_requests_pages_and_go_back_with_them(target, drafter_dir):
    config, model = target
    p = load_dspark_proposer(drafter_dir, config, "cpu", torch.float32, K, target=model)
    cache = HybridCache(config, 8, 16, 2, 0, 8, torch.float32, torch.device("cpu"), prefix_caching=False,
                        extra_mla=p.extra_mla)
    req = Request("a", list(range(40)), SamplingParams(max_tokens=4), seed=0)
    assert cache.acquire_slot(req) and cache.grow(req, 40)
    assert cache.used_pages == 3 and cache.num_free_pages == 5
    # observe writes the drafter's latents into the request's own pages (its block-table row)
    runner = TargetRunner(model, config, 1, 48)
    batch, hidden = runner.hidden([req.prompt_token_ids], p.capture_layers)
    batch.block_tables = cache.block_tables[[req.slot]]
    pages = cache.pools.mla[p.extra_layers[0]]
    before = pages.clone()
    p.observe(batch, hidden, cache.pools)
    changed = (pages != before).any(-1).any(-1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(req.pages)
    cache.release(req)
    assert cache.used_pages == 0 and cache.num_free_pages == 8


# ---- hidden capture --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["kimi-linear-tiny", "k3-tiny"])
def test_capture_layers_give_every_rows_layer_output(preset):
    config = ModelConfig.from_dict(preset_config(preset))
    model = random_reference_model(config, torch.float32, torch.device("cpu"), seed=1)
    runner = TargetRunner(model, config, 2, 32)
    seqs = random_prompts(config, 2, 12, seed=2)
    batch = runner.batch([(0, seqs[0], 0), (1, seqs[1][:5], 0)], all_logits=True)
    plain = model(batch, runner.pools)
    last = config.num_layers - 1
    model.capture_layers = (0, last)
    runner.pools.reset_slots([0, 1])
    logits = model(batch, runner.pools)
    model.capture_layers = ()
    assert torch.equal(logits, plain)                               # capturing changes nothing
    assert set(model.captured_hidden) == {0, last}
    assert model.captured_hidden[0].shape == (17, config.hidden_size)
    if not config.attn_res_block_size:
        # the last layer's output is what the final norm and the LM head read
        from kestrel.models.kimi.reference import rms_norm
        h = rms_norm(model.captured_hidden[last], model.norm, config.rms_norm_eps)
        torch.testing.assert_close(h.float() @ model.head_weight().float().t(), logits, rtol=1e-5, atol=1e-5)


# ---- observe + propose -----------------------------------------------------------------------------------------

def _observed(target, drafter_dir, prompts):
    config, model = target
    p = load_dspark_proposer(drafter_dir, config, "cpu", torch.float32, K, target=model)
    runner = TargetRunner(model, config, len(prompts), 64, extra_mla=p.extra_mla)
    # one mixed step: a long prompt chunked over two steps, short ones in one
    first = [(b, s[:9], 0) for b, s in enumerate(prompts)]
    for segments in (first, [(b, s[9:], 9) for b, s in enumerate(prompts) if len(s) > 9]):
        batch = runner.batch(segments, all_logits=True)
        model.capture_layers = p.capture_layers
        model(batch, runner.pools)
        model.capture_layers = ()
        p.observe(batch, model.captured_hidden, runner.pools)
    return p, runner


def _three_observed(target, drafter_dir, seed: int, seed0: int):
    """Three requests of 20, 7 and 14 tokens observed, and their draft inputs at their last position (greedy,
    sampled at 0.8, greedy; seeds seed0 + b)."""
    config, _ = target
    prompts = random_prompts(config, 3, 20, seed=seed)
    prompts = [prompts[0], prompts[1][:7], prompts[2][:14]]
    p, runner = _observed(target, drafter_dir, prompts)
    inputs = [DraftInput(token_ids=s, position=len(s) - 1, slot=b, seed=seed0 + b, temperature=t)
              for b, (s, t) in enumerate(zip(prompts, (0.0, 0.8, 0.0)))]
    return prompts, p, runner, inputs


def test_propose_gives_k_tokens_independent_of_the_batch(target, drafter_dir):
    config, _ = target
    prompts, p, runner, inputs = _three_observed(target, drafter_dir, 4, 10)
    together = p.propose(inputs, runner.block_tables, runner.pools)
    assert together.tokens.shape == (3, K) and together.tokens.dtype == torch.int64
    assert together.probs.shape == (3, K, config.vocab_size) and together.confidence.shape == (3, K)
    torch.testing.assert_close(together.probs.sum(-1), torch.ones(3, K))
    assert ((together.confidence > 0) & (together.confidence < 1)).all()
    for b in (0, 2):     # greedy rows: one-hot q on the drafted token
        assert torch.equal(together.probs[b].argmax(-1), together.tokens[b]) and together.probs[b].max() == 1
    assert (together.probs[1].gather(-1, together.tokens[1].unsqueeze(-1)) > 0).all()
    for order in ([2, 0, 1], [1], [0], [2]):
        sub = p.propose([inputs[i] for i in order], runner.block_tables, runner.pools)
        assert torch.equal(sub.tokens, together.tokens[order])
        if sub.probs is not None:
            torch.testing.assert_close(sub.probs, together.probs[order], rtol=1e-5, atol=1e-6)
    # only the context before the block is read: pages past each position may hold anything
    for i in p.extra_layers:
        pages = runner.pools.mla[i]
        for b, s in enumerate(prompts):
            n = len(s) - 1
            row = runner.block_tables[b]
            for pos in range(n, 64):
                pages[row[pos // 16], pos % 16] = torch.randn(pages.shape[-1])
    again = p.propose(inputs, runner.block_tables, runner.pools)
    assert torch.equal(again.tokens, together.tokens)


def test_paged_propose_matches_the_training_forward(target, drafter_dir):
    """Row 0 of a block through observe / pages / propose equals the unpaged forward (context latents computed
    in place, as the trainer computes them)."""
    config, model = target
    prompts = random_prompts(config, 2, 12, seed=6)
    p, runner = _observed(target, drafter_dir, prompts)
    a = 11
    inputs = [DraftInput(token_ids=s, position=a, slot=b, seed=0, temperature=0.0) for b, s in enumerate(prompts)]
    drafted = p.propose(inputs, runner.block_tables, runner.pools).tokens
    _, hidden = runner.hidden(prompts, p.capture_layers)
    ids = torch.tensor(prompts)
    h = [hidden[l].view(2, 12, -1) for l in p.capture_layers]
    ctx = p.drafter.context([t.reshape(24, -1) for t in h])
    lat = [t.view(2, 12, -1) for t in p.drafter.context_latents(ctx, torch.arange(12).repeat(2))]
    block = torch.full((2, K), p.dc.mask_token_id)
    block[:, 0] = ids[:, a]
    pos = a + torch.arange(K).repeat(2, 1)
    hb = p.drafter.block_hidden(torch.nn.functional.embedding(block, model.embed_tokens), pos, lat,
                                torch.arange(12).unsqueeze(0).expand(2, 12) < a)
    row0 = p.drafter.step_logits(p.drafter.base_logits(hb[:, 0], model.head_weight()), ids[:, a]).argmax(-1)
    assert torch.equal(drafted[:, 0], row0)


def test_block_is_non_causal_and_shorter_blocks_work(target, drafter_dir):
    config, model = target
    p = load_dspark_proposer(drafter_dir, config, "cpu", torch.float32, 2, target=model)
    d = p.drafter
    x = torch.randn(1, K, config.hidden_size)
    ctx = [torch.randn(1, 5, p.dc.mla_cache_width) for _ in d.layers]
    vis = torch.ones(1, 5, dtype=torch.bool)
    pos = 5 + torch.arange(K).unsqueeze(0)
    h = d.block_hidden(x, pos, ctx, vis)
    x2 = x.clone()
    x2[0, -1] += 1.0
    assert not torch.allclose(d.block_hidden(x2, pos, ctx, vis)[0, 0], h[0, 0])    # row 0 sees the last row
    vis2 = vis.clone()
    vis2[0, 3:] = False
    ctx2 = [c.clone() for c in ctx]
    for c in ctx2:
        c[0, 3:] = torch.randn_like(c[0, 3:])
    torch.testing.assert_close(d.block_hidden(x, pos, ctx2, vis2), d.block_hidden(x, pos, ctx, vis2))   # masked
    prompts = random_prompts(config, 2, 12, seed=8)
    p2, runner = _observed(target, drafter_dir, prompts)
    p2.num_tokens = 2                                   # K below the drafter's block size
    out = p2.propose([DraftInput(token_ids=s, position=11, slot=b, seed=0, temperature=0.0)
                      for b, s in enumerate(prompts)], runner.block_tables, runner.pools)
    assert out.tokens.shape == (2, 2) and out.probs is None


def test_sampled_drafts_follow_the_q_they_return():
    """Lossless acceptance needs q to be the distribution each draft was drawn from: with many seeds, the first
    draft token's frequencies match q (tiny vocabulary, Pearson's chi-square)."""
    from test_runtime_sampler import chi2_pvalue
    raw = preset_config("k3-tiny")
    raw["text_config"]["vocab_size"] = 48
    config = ModelConfig.from_dict(raw)
    model = random_reference_model(config, torch.float32, torch.device("cpu"), seed=2)
    p = DSparkProposer(random_drafter(tiny_config(config, block_size=3), config, seed=1), config, 3, model)
    runner = TargetRunner(model, config, 1, 32, extra_mla=p.extra_mla)
    prompt = random_prompts(config, 1, 10, seed=3)[0]
    batch, hidden = runner.hidden([prompt], p.capture_layers)
    p.observe(batch, hidden, runner.pools)
    n = 20000
    out = p.propose([DraftInput(token_ids=prompt, position=9, slot=0, seed=s, temperature=1.3) for s in range(n)],
                    runner.block_tables, runner.pools)
    q0 = out.probs[0, 0]
    assert torch.allclose(out.probs[:, 0], q0.expand(n, -1))          # row 0 does not depend on the seed
    assert chi2_pvalue(out.tokens[:, 0], q0.double()) > 1e-4
    assert q0.max() < 0.9                                               # not a one-hot in disguise
    # row 1's q is a function of row 0's token (the Markov head): equal tokens, equal q
    t0 = out.tokens[:, 0]
    same = (t0 == t0[0]).nonzero().flatten()
    assert len(same) > 1 and torch.allclose(out.probs[same, 1], out.probs[same[0], 1].expand(len(same), -1))
    other = (t0 != t0[0]).nonzero().flatten()[0]
    assert not torch.allclose(out.probs[other, 1], out.probs[same[0], 1])


def test_confidence_head_tensors_are_skipped_when_the_config_does_not_enable_it(target, drafter_dir):
    config, model = target
    d = scratch_dir("drafter-noconf")
    write_tensors(d, read_tensors(drafter_dir), index=False)
    raw = tiny_config(config, block_size=K).to_dict()
    raw["enable_confidence_head"] = False
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(raw, f)
    p = load_dspark_proposer(d, config, "cpu", torch.float32, K, target=model)
    assert not hasattr(p.drafter, "confidence_head")
    runner = TargetRunner(model, config, 1, 32, extra_mla=p.extra_mla)
    prompt = random_prompts(config, 1, 10, seed=3)[0]
    batch, hidden = runner.hidden([prompt], p.capture_layers)
    p.observe(batch, hidden, runner.pools)
    out = p.propose([DraftInput(prompt, 9, 0, 0, 0.0)], runner.block_tables, runner.pools)
    assert out.confidence is None and out.tokens.shape == (1, K)


def test_block_over_the_pages_equals_the_gathered_context(target, drafter_dir):
    """The paged block (MlaCacheWrite + MlaDecode catalog entries over the draft layers' pages: the CUDA path) drafts
    what the reference's gathered context drafts: same tokens, q within fp32 rounding, for requests of different
    lengths, greedy and sampled; and a request whose pages end inside the block (a block the scheduler cut short)
    writes nothing outside them."""
    prompts, p, runner, inputs = _three_observed(target, drafter_dir, 9, 3)
    p.paged = False
    want = p.propose(inputs, runner.block_tables, runner.pools)
    p.paged = True
    got = p.propose(inputs, runner.block_tables, runner.pools)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-4, atol=1e-5)
    # request 1 (7 tokens, position 6) with one page only: block rows at positions >= 16 would be past its pages
    tables = runner.block_tables.clone()
    tables[1, 1:] = -1
    pools_before = {i: runner.pools.mla[i].clone() for i in p.extra_layers}
    late = [DraftInput(token_ids=prompts[1] + [5] * 7, position=13, slot=1, seed=0, temperature=0.0)]
    out = p.propose(late, tables, runner.pools)
    assert out.tokens.shape == (1, K)
    for i in p.extra_layers:
        changed = (runner.pools.mla[i] != pools_before[i]).any(-1).nonzero().tolist()
        assert changed and all(page == tables[1, 0] and 13 <= row < 16 for page, row in changed), changed


def test_observe_through_the_cache_write_entry_equals_the_reference_scatter(target, drafter_dir):
    """observe's CUDA path (MlaCacheWrite over the step's device req_idx, no host sync) writes exactly the pages the
    reference's scatter writes."""
    config, model = target
    prompts = random_prompts(config, 2, 12, seed=11)
    pools = {}
    for paged in (False, True):
        p = load_dspark_proposer(drafter_dir, config, "cpu", torch.float32, K, target=model)
        p.paged = paged
        runner = TargetRunner(model, config, len(prompts), 64, extra_mla=p.extra_mla)
        batch = runner.batch([(b, s, 0) for b, s in enumerate(prompts)], all_logits=True)
        batch.req_idx = torch.arange(2, dtype=torch.int32).repeat_interleave(12)
        model.capture_layers = p.capture_layers
        model(batch, runner.pools)
        model.capture_layers = ()
        p.observe(batch, model.captured_hidden, runner.pools)
        pools[paged] = [runner.pools.mla[i].clone() for i in p.extra_layers]
    for a, b in zip(pools[False], pools[True]):
        assert a.abs().sum() > 0 and torch.equal(a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_confidence_of_each_row_reads_its_hidden_state_and_the_token_before_it(target, fused):
    """draft() computes every row's confidence after the Markov loop in one call: row k's equals the head applied to
    h[:, k] and the token drafted before it (the last token for row 0), as one row at a time would compute it; the
    fused Markov step (the DraftStep entry) drafts the reference loop's tokens and q."""
    config, _ = target
    d = random_drafter(tiny_config(config, block_size=K), config, seed=4)
    R, V = 3, config.vocab_size
    g = torch.Generator().manual_seed(5)
    base = torch.randn(R, K, V, generator=g) * 3
    h = torch.randn(R, K, config.hidden_size, generator=g)
    last = torch.randint(0, V, (R,), generator=g)
    temps = torch.tensor([0.0, 0.9, 1.2])
    u = torch.rand(R, K, generator=g, dtype=torch.float64)
    with torch.no_grad():
        tokens, probs, conf = d.draft(base, h, last, temps, u, fused=fused)
        ref_tokens, ref_probs, _ = d.draft(base, h, last, temps, u)
    prev = torch.cat([last.unsqueeze(1), tokens[:, :-1]], 1)
    for k in range(K):
        torch.testing.assert_close(conf[:, k], torch.sigmoid(d.confidence_logit(h[:, k], prev[:, k])).detach())
    if fused:
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(probs, ref_probs, rtol=1e-4, atol=1e-9)
