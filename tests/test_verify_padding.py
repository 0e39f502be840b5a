"""Padded verify steps (what a verify CUDA graph replays; on the CPU the padded path runs eagerly): a step whose
every request verifies a block of K + 1 tokens, padded to its batch bucket with blocks on the scratch slot and page,
scores the live blocks as the unpadded step does, and after `commit_verify` (the padding blocks given 0 tokens) every
request's KDA state and MLA pages are the unpadded step's; slots and pages no request holds are never written. Run
on the reference model and on both sm_90 targets (tiny widths, fp32; the targets' Triton kernels under the
interpreter on the CPU). And the runner's replay path for a verify bucket, with a stand-in for the CUDA graph that
reruns the captured batch: equal to the eager step, with the model pointed back at the capture's replay buffers."""

from __future__ import annotations

import pytest
import torch

from helpers import single_thread  # noqa: F401
from test_spec_targets import TARGETS, _build

from kestrel.runtime.cache import HybridCache
from kestrel.runtime.graphs import ModelRunner
from kestrel.runtime.inputs import StepInputs

K = 3                  # drafts per block: blocks of 4 tokens
PAGE = 4
CONTEXTS = (9, 6, 13)  # three requests (padded to bucket 4), blocks crossing page boundaries
ACCEPTED = (1, 4, 2)   # tokens kept per block: none of the drafts, all of them, one


@pytest.fixture(scope="module", params=["reference:k3-tiny"] + sorted(TARGETS))
def model(request):
    kind, _, preset = request.param.rpartition(":")
    config, ref, target = _build(preset)
    return config, ref if kind == "reference" else target


def _cache(config, seed: int) -> tuple[HybridCache, list[int]]:
    """A cache full of random garbage (every page, every slot, the scratch ones too) with three requests on slots
    that are not 0..2 and pages that are not in order; returns it and the requests' slots."""
    cache = HybridCache(config, num_pages=16, page_size=PAGE, num_slots=6, num_snapshots=0, max_pages_per_seq=5,
                        dtype=torch.float32, device=torch.device("cpu"), prefix_caching=False)
    g = torch.Generator().manual_seed(seed)
    pools = cache.pools
    for t in list(pools.mla.values()) + list(pools.conv.values()) + list(pools.recurrent.values()):
        t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    slots = [4, 1, 3]
    pages = torch.randperm(16, generator=g)[:15].view(3, 5).to(torch.int32)
    for s, row in zip(slots, pages):
        cache.block_tables[s] = row
    return cache, slots


def _step(model, config, padded: bool, tokens):
    """One verify step of the three blocks through a ModelRunner (padding on or off), then commit ACCEPTED."""
    cache, slots = _cache(config, seed=11)
    inputs = StepInputs(4, 64, PAGE, cache.max_pages_per_seq, cache.device, logits_rows_per_seq=K + 1)
    runner = ModelRunner(model, cache, inputs, max_num_seqs=4, enforce_eager=not padded, verify_len=K + 1)
    R = K + 1
    flat, positions, cu = [], [], [0]
    for toks, ctx in zip(tokens, CONTEXTS):
        flat += toks
        positions += range(ctx, ctx + R)
        cu.append(cu[-1] + R)
    batch = inputs.fill(flat, positions, cu, list(CONTEXTS), slots, list(range(cu[-1])), cache.block_tables, [],
                        verify_segments=(0, 1, 2))
    assert runner.is_verify_bucket(batch) == padded
    assert batch.padded_rows == (1 if padded else 0) and batch.verify_segments == tuple(range(4 if padded else 3))
    logits = runner(batch)
    runner.commit_verify(list(ACCEPTED))
    return logits, cache, slots


def _close(a, b, rel=1e-5):
    return (a - b).abs().max().item() <= rel * max(1.0, b.abs().max().item())


def test_padded_verify_equals_unpadded_and_leaves_other_state_alone(model):
    config, m = model
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, config.vocab_size, (K + 1,), generator=g).tolist() for _ in CONTEXTS]
    want, plain, slots = _step(m, config, False, tokens)
    got, padded, _ = _step(m, config, True, tokens)
    untouched, _ = _cache(config, seed=11)
    assert got.shape == want.shape == (3 * (K + 1), config.vocab_size)
    assert _close(got, want, 1e-4), (got - want).abs().max()
    scratch_slot, scratch_page = padded.scratch_slot, padded.scratch_page
    for i in padded.pools.conv:
        for pool in ("conv", "recurrent"):
            a, b, c = (getattr(x.pools, pool)[i] for x in (padded, plain, untouched))
            for s in range(a.shape[0]):
                if s in slots:        # the requests' slots: committed over exactly the accepted tokens
                    assert _close(a[s], b[s]), (pool, i, s)
                    if ACCEPTED[slots.index(s)]:
                        assert not torch.equal(a[s], c[s]), "commit_verify must advance the state"
                elif s != scratch_slot:
                    assert torch.equal(a[s], c[s]), f"padding blocks wrote {pool} slot {s} of layer {i}"
    for i in padded.pools.mla:
        a, b, c = padded.pools.mla[i], plain.pools.mla[i], untouched.pools.mla[i]
        for p in range(a.shape[0]):
            if p != scratch_page:       # live pages hold the unpadded step's latents; free pages stay as they were
                assert _close(a[p], b[p]), (i, p)
        used = {int(x) for s in slots for x in padded.block_tables[s]}
        free = [p for p in range(a.shape[0]) if p not in used and p != scratch_page]
        assert free and all(torch.equal(a[p], c[p]) for p in free)


class _Replay:
    """Stands in for a CUDA graph on the CPU: `replay()` reruns the forward on the batch it was "captured" with.
    That batch's tensors are views of the static verify buffers (they hold the current step's inputs) while its host
    fields (context lengths, slots) stay the capture's padding ones, as in a real graph: so a replay equals the
    eager step only if the step reads its inputs from the device buffers alone. A replay runs no Python: what the
    forward leaves on the model (its replay buffers' views, `graph_state`) is put back as it was before."""

    def __init__(self, model, fn):
        self.model, self.fn, self.replays = model, fn, 0

    def replay(self):
        self.replays += 1
        before = self.model.graph_state()
        self.fn()
        self.model.set_graph_state(before)


@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_a_replayed_verify_step_equals_the_eager_one(preset):
    """The runner's replay path for a verify bucket (on the CPU with `_Replay` for the graph): logits from the
    verify buffer, the model pointed back at the capture's replay buffers (`set_graph_state`), commit_verify with
    the padding blocks given 0 tokens; the result equals the unpadded eager step."""
    config, _, m = _build(preset)
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, config.vocab_size, (K + 1,), generator=g).tolist() for _ in CONTEXTS]
    want, plain, slots = _step(m, config, False, tokens)

    cache, slots = _cache(config, seed=11)
    inputs = StepInputs(4, 64, PAGE, cache.max_pages_per_seq, cache.device, logits_rows_per_seq=K + 1)
    runner = ModelRunner(m, cache, inputs, max_num_seqs=4, verify_len=K + 1)
    variants = m.decode_variants(1024)
    key = (4, K, m.decode_variant([0]))
    static = runner._padding_batch(key, variants)
    m(static, cache.pools)                                        # the eager run before capture
    runner.verify_logits = torch.empty(4 * (K + 1), config.vocab_size)
    graph = _Replay(m, lambda: runner.verify_logits.copy_(m(static, cache.pools)))
    graph.fn()                                                    # "capture"
    runner.verify_graphs[key], runner.graph_state[key] = graph, m.graph_state()
    between = inputs.fill([0], [0], [0, 1], [0], [cache.scratch_slot], [0], cache.block_tables, [])
    m(between, cache.pools)              # a decode step in between: the model's own replay state is gone
    R = K + 1
    flat = [t for toks in tokens for t in toks]
    positions = [p for ctx in CONTEXTS for p in range(ctx, ctx + R)]
    batch = inputs.fill(flat, positions, list(range(0, 3 * R + 1, R)), list(CONTEXTS), slots, list(range(3 * R)),
                        cache.block_tables, [], verify_segments=(0, 1, 2))
    got = runner(batch)
    assert graph.replays == 1 and runner.verify_replays == 1
    runner.commit_verify(list(ACCEPTED))
    assert got.shape == want.shape and _close(got, want, 1e-4)
    for i in cache.pools.conv:
        for pool in ("conv", "recurrent"):
            a, b = getattr(cache.pools, pool)[i], getattr(plain.pools, pool)[i]
            for s in slots:
                assert _close(a[s], b[s]), (pool, i, s)
