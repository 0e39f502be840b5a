"""Padded DSpark proposes (what a propose CUDA graph replays; on the CPU the padded path runs eagerly): a propose of R
requests padded to its bucket on the static buffers (padding rows greedy, on a scratch block-table row) drafts what
the unpadded propose over the pages drafts: the same tokens, q and confidence within fp32 rounding, greedy and
sampled rows; q only when a row samples; the padding rows write only the scratch row's pages, and both write a
request's pages only at its block's positions. The replay path (a stand-in graph) counts replays and reads the
static buffers; through the engine, greedy with a padded-propose drafter equals greedy without speculation; and the
step a decode / verify graph holds with the drafter's observe inside writes the drafter's pages as the eager step
and observe do."""

from __future__ import annotations

import pytest
import torch

from helpers import scratch_dir, single_thread  # noqa: F401  (single_thread: autouse)
from kestrel.config import ModelConfig
from kestrel.models.kimi.checkpoint import preset_config, random_reference_model
from kestrel.spec.dspark import load_dspark_proposer
from kestrel.spec.dspark_checkpoint import write_random_drafter
from kestrel.spec.dspark_config import tiny_config
from kestrel.spec.proposer import DraftInput
from kestrel.spec.train import TargetRunner, random_prompts

K = 4
PAGE = 16
SCRATCH = 3           # the runner's slot 3: its block-table row stands for the scratch row (its pages: scratch pages)
LENGTHS = (20, 7, 14)


@pytest.fixture(scope="module")
def observed():
    """Three requests of 20, 7 and 14 tokens observed into a paged drafter's pages (slots 0..2; slot 3 unused)."""
    config = ModelConfig.from_dict(preset_config("k3-tiny"))
    model = random_reference_model(config, torch.float32, torch.device("cpu"), seed=3)
    drafter = write_random_drafter(scratch_dir("drafter-padding"), tiny_config(config, block_size=K), config, seed=5)
    p = load_dspark_proposer(drafter, config, "cpu", torch.float32, K, target=model)
    p.paged = True
    runner = TargetRunner(model, config, 4, 64, page_size=PAGE, extra_mla=p.extra_mla)
    prompts = [s[:n] for s, n in zip(random_prompts(config, 3, 20, seed=4), LENGTHS)]
    batch = runner.batch([(b, s, 0) for b, s in enumerate(prompts)], all_logits=True)
    model.capture_layers = p.capture_layers
    model(batch, runner.pools)
    model.capture_layers = ()
    p.observe(batch, model.captured_hidden, runner.pools)
    g = torch.Generator().manual_seed(9)
    for i in p.extra_layers:           # the scratch row's pages: garbage, as the scratch page is in serving
        pages = runner.pools.mla[i]
        pages[runner.block_tables[SCRATCH].long()] = torch.randn(pages[0:4].shape, generator=g)
    return config, p, runner, prompts


def _inputs(prompts, temps):
    return [DraftInput(token_ids=s, position=len(s) - 1, slot=b, seed=10 + b, temperature=t)
            for b, (s, t) in enumerate(zip(prompts, temps))]


def _propose(p, runner, inputs, padded: bool):
    """A propose from a copy of the pools; returns the block (cloned) and the drafter pools after it."""
    pools = runner.pools
    saved = {i: pools.mla[i].clone() for i in p.extra_layers}
    tables = runner.block_tables if padded else runner.block_tables.clone()   # another table: the eager path
    out = p.propose(inputs, tables, pools)
    block = tuple(None if t is None else t.clone() for t in (out.tokens, out.probs, out.confidence))
    after = {i: pools.mla[i].clone() for i in p.extra_layers}
    for i in p.extra_layers:
        pools.mla[i].copy_(saved[i])
    return block, after, saved


@pytest.mark.parametrize("buckets", [[1, 2, 4], [8]], ids=["pad1", "pad5"])
@pytest.mark.parametrize("temps", [(0.0, 0.8, 0.0), (0.0, 0.0, 0.0)], ids=["mixed", "greedy"])
def test_padded_propose_equals_unpadded_and_writes_only_the_scratch_pages(observed, buckets, temps):
    config, p, runner, prompts = observed
    inputs = _inputs(prompts, temps)
    p.pad_to(buckets, runner.block_tables, SCRATCH)
    assert p.buckets == buckets and p.bucket_for(3) == buckets[-1]
    (t0, q0, c0), want_pools, before = _propose(p, runner, inputs, padded=False)
    (t1, q1, c1), got_pools, _ = _propose(p, runner, inputs, padded=True)
    assert t1.shape == t0.shape == (3, K) and torch.equal(t1, t0)
    assert (q1 is None) == (q0 is None) == (max(temps) == 0.0)
    if q0 is not None:
        assert q1.shape == (3, K, config.vocab_size)
        torch.testing.assert_close(q1, q0, rtol=1e-5, atol=1e-6)
        assert q1[1].max() < 1 and torch.equal(q1[0].argmax(-1), t1[0]) and q1[0].max() == 1
    torch.testing.assert_close(c1, c0, rtol=1e-5, atol=1e-6)
    scratch = {int(x) for x in runner.block_tables[SCRATCH]}
    for i in p.extra_layers:
        for page in range(before[i].shape[0]):
            if page not in scratch:   # outside the scratch pages the padded propose writes what the unpadded one does
                torch.testing.assert_close(got_pools[i][page], want_pools[i][page], rtol=1e-5, atol=1e-6)
        # ... and that is each request's block positions p .. p+K-1 only
        changed = (want_pools[i] != before[i]).any(-1).nonzero().tolist()
        allowed = {(int(runner.block_tables[b, pos // PAGE]), pos % PAGE)
                   for b, n in enumerate(LENGTHS) for pos in range(n - 1, n - 1 + K)}
        assert changed and {tuple(c) for c in changed} <= allowed
        if buckets[-1] > 3:           # padding rows ran: they wrote the scratch row's first page, nothing else
            moved = (got_pools[i] != want_pools[i]).any(-1).nonzero().tolist()
            assert moved and all(page in scratch for page, _ in moved)


class _Replay:
    """Stands in for a CUDA graph on the CPU: `replay()` reruns what was "captured", the padded propose of bucket n
    over the static buffers (so a replay equals the eager propose only if the inputs go through those buffers)."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


def test_a_replayed_propose_equals_the_eager_one(observed):
    config, p, runner, prompts = observed
    inputs = _inputs(prompts, (0.7, 0.0, 1.1))
    p.pad_to([1, 2, 4], runner.block_tables, SCRATCH)
    (want, q0, c0), _, _ = _propose(p, runner, inputs, padded=False)
    p.fill_padding(4)
    p.run_padded(4, runner.pools)
    graph = _Replay(lambda: p.run_padded(4, runner.pools))
    p.graphs[4] = graph
    (got, q1, c1), _, _ = _propose(p, runner, inputs, padded=True)
    assert graph.replays == 1 and p.replays == 1
    assert torch.equal(got, want)
    torch.testing.assert_close(q1, q0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c1, c0, rtol=1e-5, atol=1e-6)
    two = p.propose(inputs[:2], runner.block_tables, runner.pools)      # bucket 2: no graph, run padded eagerly
    assert graph.replays == 1 and torch.equal(two.tokens, want[:2])
    p.graphs.clear()


def test_padded_propose_through_the_engine_equals_plain_greedy(monkeypatch, tmp_path):
    """A paged DSpark drafter in the engine on the CPU: the runner pads its proposes to the verify buckets (run
    eagerly), and greedy output with speculation equals greedy output without it, token for token."""
    from test_runtime_helpers import greedy, make_engine, solo_tokens, tiny_checkpoint
    from kestrel.spec import dspark
    prompts = [s for s in random_prompts(ModelConfig.from_dir(tiny_checkpoint("k3-tiny")), 3, 24, seed=2)]
    prompts = [prompts[0], prompts[1][:9], prompts[2][:17]]
    max_tokens = [9, 7, 8]
    solo = solo_tokens("k3-tiny", prompts, max_tokens)
    config = ModelConfig.from_dir(tiny_checkpoint("k3-tiny"))
    drafter = write_random_drafter(str(tmp_path / "drafter"), tiny_config(config, block_size=K), config, seed=5)
    load = dspark.load_dspark_proposer

    def paged_load(*a, **kw):
        prop = load(*a, **kw)
        prop.paged = True
        return prop

    monkeypatch.setattr(dspark, "load_dspark_proposer", paged_load)
    engine = make_engine("k3-tiny", max_num_seqs=4, speculative_config={
        "method": "dspark", "model": drafter, "num_speculative_tokens": K, "enforce": True})
    p = engine.proposer
    assert p.buckets and p.buckets == engine.runner.verify_buckets
    runs = []
    real = p.run_padded
    monkeypatch.setattr(p, "run_padded", lambda n, pools: (runs.append(n), real(n, pools))[1])
    rids = [engine.add_request(s, greedy(n)) for s, n in zip(prompts, max_tokens)]
    while engine.has_unfinished():
        engine.step()
    assert [list(engine.final_output(r).token_ids) for r in rids] == solo
    assert runs and engine.stats()["spec"]["verify_blocks"] > 0


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_observe_as_a_step_graph_runs_it_writes_what_eager_observe_writes(verify):
    """The step a decode / verify graph holds with the drafter's observe inside (`_step_and_observe` on the padded
    static batch, padding on the scratch row) writes the drafter's pages as the unpadded step + the engine's observe
    do: equal everywhere but the scratch page, and only at the step's positions of the requests' pages."""
    from kestrel.runtime.cache import HybridCache
    from kestrel.runtime.graphs import ModelRunner
    from kestrel.runtime.inputs import StepInputs
    config = ModelConfig.from_dict(preset_config("k3-tiny"))
    model = random_reference_model(config, torch.float32, torch.device("cpu"), seed=3)
    drafter = write_random_drafter(scratch_dir("drafter-observe"), tiny_config(config, block_size=K), config, seed=5)
    contexts, slots, ps = (9, 6, 13), [4, 1, 3], 4
    R = K + 1 if verify else 1
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, config.vocab_size, (3 * R,), generator=g).tolist()
    pages = {}
    for graph in (False, True):
        p = load_dspark_proposer(drafter, config, "cpu", torch.float32, K, target=model)
        p.paged = True
        cache = HybridCache(config, num_pages=16, page_size=ps, num_slots=6, num_snapshots=0, max_pages_per_seq=5,
                            dtype=torch.float32, device=torch.device("cpu"), prefix_caching=False,
                            extra_mla=p.extra_mla)
        gen = torch.Generator().manual_seed(11)
        for i in p.extra_layers:
            cache.pools.mla[i].copy_(torch.randn(cache.pools.mla[i].shape, generator=gen))
        for s, row in zip(slots, torch.randperm(16, generator=gen)[:15].view(3, 5).to(torch.int32)):
            cache.block_tables[s] = row
        before = {i: cache.pools.mla[i].clone() for i in p.extra_layers}
        model.capture_layers = p.capture_layers
        inputs = StepInputs(4, 64, ps, 5, cache.device, logits_rows_per_seq=R)
        runner = ModelRunner(model, cache, inputs, 4, enforce_eager=not graph, verify_len=R if verify else 0,
                             proposer=p)
        batch = inputs.fill(tokens, [c + j for c in contexts for j in range(R)], list(range(0, 3 * R + 1, R)),
                            list(contexts), slots, list(range(3 * R)) if verify else [0, 1, 2], cache.block_tables,
                            [], verify_segments=(0, 1, 2) if verify else ())
        assert (runner.is_verify_bucket(batch) if verify else runner.is_decode_bucket(batch)) == graph
        if graph:
            runner.observe_in_graphs = True           # what capture sets for a drafter whose observe is capturable
            assert p.observe_capturable and batch.padded_rows == 1
            runner._step_and_observe(batch)
        else:
            model(batch, cache.pools)
            p.observe(batch, model.captured_hidden, cache.pools)
        model.capture_layers = ()
        pages[graph] = {i: cache.pools.mla[i].clone() for i in p.extra_layers}
    allowed = {(int(cache.block_tables[s, pos // ps]), pos % ps)
               for s, c in zip(slots, contexts) for pos in range(c, c + R)}
    for i in p.extra_layers:
        for page in range(16):        # not the scratch page (16): the padded step's padding rows write there
            # (fp32 GEMMs of another row count in the target's forward: 1e-6 apart)
            torch.testing.assert_close(pages[True][i][page], pages[False][i][page], rtol=1e-4, atol=1e-5)
        changed = {tuple(c) for c in (pages[False][i] != before[i]).any(-1).nonzero().tolist()}
        assert changed == allowed
