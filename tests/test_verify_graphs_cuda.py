"""Speculative verify steps under CUDA graphs on a GPU (skipped without CUDA), on both bf16 sm_90 targets at tiny
widths.

- At batch 1, 8 and 32, greedy with speculation (an oracle proposer that drafts the plain continuation with misses,
  so blocks are accepted in full, in part and not at all) gives the same tokens with verify graphs on as with them
  off (the same padded steps run eagerly: the same kernels, so the logits are bitwise equal), and the verify
  steps really replayed graphs (counted).
- A random DSpark drafter through the engine (its context written from the captured hidden states of every step,
  verify graphs included; its proposes replaying the propose graphs; its observe inside the step graphs) at batch 1,
  8 and 32: graphs on equals graphs off, token for token and draft for draft, and both kinds of graph replayed
  (counted); a padded propose makes no host sync.
Run on the GPU machine: `python -m pytest -q tests/test_verify_graphs_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from test_graphs_cuda import PRESETS, TARGETS, _engine, checkpoints  # noqa: F401
from helpers import step_without_host_sync
from test_spec_engine import Oracle

from kestrel.config import EngineConfig
from kestrel.llm import build_engine
from kestrel.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

K = 4
TOKENS = 24
ENFORCED = {"method": "ngram", "num_speculative_tokens": K, "enforce": True}


def _prompts(engine, batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, engine.config.vocab_size, (int(n),), generator=gen).tolist()
            for n in torch.randint(8, 40, (batch,), generator=gen)]


def _greedy(engine, prompts) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
           for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [list(engine.final_output(i).token_ids) for i in ids]


def _spec_engine(path, graphs: bool, spec, max_num_seqs: int):
    """A speculating engine on the checkpoint's bf16 target: built on the reference model (not capturable: nothing
    captured), then the target swapped in, given the proposer's capture layers, and captured; `graphs` False keeps
    the padding (the same padded steps) but captures nothing, so every step runs eagerly."""
    import importlib
    import os
    ec = EngineConfig(model=path, dtype="bfloat16", device="cuda", modeling="off", max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=2048, enable_prefix_caching=False, max_model_len=4096,
                      kv_cache_tokens=64 * 1024, speculative_config=spec)
    engine = build_engine(ec)
    preset = next(p for p in TARGETS if os.path.basename(path).startswith(p))
    target = importlib.import_module(f"kestrel.models.kimi.targets.{TARGETS[preset]}.modeling").build(
        engine.model, engine.config)
    target.capture_layers = tuple(engine.proposer.capture_layers)
    engine.model = engine.runner.model = target
    if hasattr(engine.proposer, "share_target"):
        engine.proposer.share_target(target)
    engine.runner.capturable = graphs
    engine.runner.capture(engine.max_model_len)
    assert bool(engine.runner.verify_graphs) == graphs and engine.runner.verify_buckets
    return engine


@pytest.fixture(scope="module")
def plain_engines(checkpoints):
    """One plain (no speculation) graphs engine per preset, shared by the batch sizes: the oracle's truth."""
    return {preset: _engine(checkpoints[preset], False, max_num_seqs=32) for preset in PRESETS}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_verify_graphs_equal_eager(checkpoints, plain_engines, preset, batch):
    path = checkpoints[preset]
    plain = plain_engines[preset]
    prompts = _prompts(plain, batch, seed=batch)
    truth = _greedy(plain, prompts)
    runs = []
    for graphs in (True, False):
        engine = _spec_engine(path, graphs, ENFORCED, 32)
        engine.proposer = Oracle(prompts, truth, k=K, p_right=0.7)
        runs.append((_greedy(engine, prompts), engine))
    (got, on), (want, off) = runs
    assert got == want
    assert on.runner.verify_replays > 0 and off.runner.replays == 0
    assert on.stats()["spec"]["accepted_tokens"] > 0


def _dspark_spec(path, tmp_path) -> dict:
    from kestrel.config import ModelConfig
    from kestrel.spec.dspark_checkpoint import write_random_drafter
    from kestrel.spec.dspark_config import tiny_config
    config = ModelConfig.from_dir(path)
    drafter = write_random_drafter(str(tmp_path / "drafter"), tiny_config(config, block_size=K), config, seed=5,
                                   dtype=torch.bfloat16)
    return {"method": "dspark", "model": drafter, "num_speculative_tokens": K, "enforce": True}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_dspark_drafter_with_verify_and_propose_graphs(checkpoints, preset, batch, tmp_path):
    """A random DSpark drafter through the engine at batch 1, 8 and 32: graphs on (decode / verify steps with the
    drafter's observe inside, and proposes, replay graphs) gives the same tokens and the same drafts as graphs off
    (the same padded steps, observes and proposes run eagerly)."""
    path = checkpoints[preset]
    spec = _dspark_spec(path, tmp_path)
    outs, drafts = [], []
    for graphs in (True, False):
        engine = _spec_engine(path, graphs, spec, 32)
        prompts = _prompts(engine, batch, seed=3 + batch)
        p = engine.proposer
        assert p.buckets == engine.runner.verify_buckets and bool(p.graphs) == graphs
        assert engine.runner.observe_in_graphs == graphs
        seen, propose = [], p.propose
        p.propose = lambda *a: (lambda b: (seen.append(b.tokens.tolist()), b)[1])(propose(*a))
        outs.append(_greedy(engine, prompts))
        drafts.append(seen)
        if graphs:
            assert engine.runner.verify_replays > 0 and p.replays > 0
        else:
            assert p.replays == 0
    assert outs[0] == outs[1]
    # the drafts too: the context the step graphs wrote (observe inside them) is the one eager steps write
    assert drafts[0] == drafts[1] and len(drafts[0]) > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_padded_propose_makes_no_host_sync(checkpoints, preset, tmp_path):
    """A padded propose run eagerly (graphs set aside) under CUDA's sync debug mode: its inputs' copies, the block
    forward over the pages, the LM head, the Markov loop and the draws (greedy and sampled rows) never sync."""
    from helpers import host_syncs_raise
    engine = _spec_engine(checkpoints[preset], True, _dspark_spec(checkpoints[preset], tmp_path), 8)
    p = engine.proposer
    p.graphs.clear()
    prompts = [list(range(3, 3 + n)) for n in (12, 30, 7)]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0.8 * (i % 2), max_tokens=16, ignore_eos=True))
    engine.step()                                   # prefill (eager, may sync)
    sched = engine.scheduler.schedule()
    engine.cache.flush_block_tables()
    from kestrel.spec.proposer import DraftInput
    inputs = [DraftInput(s.req.all_token_ids, s.req.num_computed, s.req.slot, s.req.seed, s.req.params.temperature)
              for s in sched]
    torch.cuda.synchronize()
    with host_syncs_raise():
        block = p.propose(inputs, engine.cache.block_tables, engine.cache.pools)
    assert block.tokens.shape == (3, K) and block.probs is not None and block.probs.shape[:2] == (3, K)


@pytest.mark.parametrize("preset", PRESETS)
def test_dspark_propose_then_verify_launch_make_no_host_sync(checkpoints, preset, tmp_path):
    """The engine's propose (a DSpark drafter, its graphs replayed) and the verify step's build and launch under
    CUDA's sync debug mode: the drafts stay on the device (written into the verify's input rows there), so the host
    queues the verify behind the propose without waiting for it; the verify's input rows are the drafts. Acceptance
    then launches without a sync too (its host inputs go up through pinned memory)."""
    from helpers import host_syncs_raise
    engine = _spec_engine(checkpoints[preset], True, _dspark_spec(checkpoints[preset], tmp_path), 8)
    engine.runner.verify_graphs.clear()
    prompts = [list(range(3, 3 + n)) for n in (12, 30, 7)]
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0.8 * (i % 2), max_tokens=16, ignore_eos=True))
    engine.step()                                   # prefill (eager, may sync)
    sched = engine.scheduler.schedule()
    assert sched and all(s.drafts == K for s in sched)
    engine.cache.flush_block_tables()
    with host_syncs_raise():
        draft, _ = engine._propose(sched)
    assert engine.proposer.replays > 0 and all(s.draft_tokens is None for s in sched)
    batch, blocks, logits = step_without_host_sync(engine, sched, draft)
    ids = batch.token_ids[:3 * (K + 1)].view(3, K + 1)
    assert torch.equal(ids[:, 1:], draft.tokens[:3])
    assert ids[:, 0].tolist() == [s.req.output_token_ids[-1] for s in sched]
    assert len(blocks) == 3 and logits.shape[0] == 3 * (K + 1)
    with host_syncs_raise():                        # acceptance queues behind the verify, the host still ahead
        res = engine._accept_on_device(logits, sched, blocks, draft)
    host = engine._accept(logits, sched, blocks, draft)   # the same keys: the same draws, now read back
    assert [a for _, a in host] == res.num_accepted.tolist() and all(0 <= a <= K for _, a in host)
    assert [t for t, _ in host] == res.tokens.tolist()


@pytest.mark.parametrize("preset", PRESETS)
def test_verify_step_makes_no_host_sync(checkpoints, preset):
    """Build and run a padded verify step eagerly (graphs set aside, padding on) under CUDA's sync debug mode: a
    host sync in the inputs, the block-table flush, the StepPlan or any kernel launch of the verify forward raises.
    (The proposer runs before, acceptance and commit_verify after: not part of the step.)"""
    engine = _spec_engine(checkpoints[preset], True, ENFORCED, 8)
    engine.runner.verify_graphs.clear()
    prompts = [list(range(3, 3 + n)) for n in (12, 30, 7)]
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    engine.proposer = Oracle(prompts, [[5] * 16] * 3, k=K)
    engine.step()                                   # prefill (eager, may sync)
    sched = engine.scheduler.schedule()
    assert sched and all(s.drafts == K for s in sched)
    draft, _ = engine._propose(sched)
    batch, blocks, logits = step_without_host_sync(engine, sched, draft)
    assert engine.runner.is_verify_bucket(batch) and batch.padded_rows == 1 and len(blocks) == 3
    assert logits.shape[0] == 3 * (K + 1)
