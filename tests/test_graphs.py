"""Decode CUDA graphs on the CPU: the padded static-shape decode path (what a graph replays on a GPU) runs eagerly
here, so these tests prove that padding rows never touch a request's state, that the padded path gives the eager
path's logits and tokens, that a decode step's plan uploads nothing, and that the block table flushes as one
indexed copy. tests/test_graphs_cuda.py checks graph replay against eager bitwise on a GPU."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_runtime_helpers import greedy, make_engine, random_prompts

import kestrel.catalog._step_plan as step_plan
from kestrel.catalog._step_plan import MAX_VERIFY, StepPlan, decode_variant, decode_variants
from kestrel.config import ModelConfig
from kestrel.models.kimi.checkpoint import preset_config
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.graphs import ModelRunner, decode_buckets
from kestrel.runtime.request import Request
from kestrel.sampling_params import SamplingParams

TARGETS = {"k3-tiny": "kimi_k3_bf16__sm_90__default", "kimi-linear-tiny": "kimi_linear_bf16__sm_90__default"}


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]


def test_decode_variants_cover_every_context():
    variants = decode_variants(131072)
    assert set(variants) == {1, 8, 32}
    for ctx in (0, 100, 510, 511, 2046, 2047, 8190, 8191, 100000):
        for n in (1, 2, 4, 5, 8, 64):
            v = decode_variant([ctx] + [3] * (n - 1))
            # the variant is one the capture makes for that batch: its padding batch selects it
            assert v in variants and decode_variant([variants[v]] * n) == v
    assert decode_variant([4000]) == 32 and decode_variant([4000] * 4) == 32 and decode_variant([4000] * 5) == 8
    assert decode_variant([1000]) == 8 and decode_variant([100]) == 1
    assert set(decode_variants(256)) == {1} and set(decode_variants(1024)) == {1, 8}


class _Recorder:
    """Wraps an engine's model: keeps every step's batch layout and its live logits rows."""

    def __init__(self, engine):
        self.model = engine.runner.model
        self.steps = []
        engine.runner.model = self

    def __call__(self, batch, pools):
        out = self.model(batch, pools)
        live = batch.num_reqs - batch.padded_rows
        rows = out[:live] if batch.padded_rows else out
        self.steps.append((batch.num_reqs, batch.padded_rows, rows.clone()))
        return out


def _pool_state(cache, pages: list[int], slots: list[int]) -> list[torch.Tensor]:
    out = [t[pages].clone() for _, t in sorted(cache.pools.mla.items())]
    out += [t[slots].clone() for _, t in sorted(cache.pools.conv.items())]
    out += [t[slots].clone() for _, t in sorted(cache.pools.recurrent.items())]
    return out


def make(preset: str, target: bool = False, **kw):
    """A tiny CPU engine on the reference model, or on the preset's fast-path target built directly (the router
    only lets targets claim real widths; on the CPU their Triton kernels run under the interpreter)."""
    eng = make_engine(preset, **kw)
    if target:
        mod = importlib.import_module(f"kestrel.models.kimi.targets.{TARGETS[preset]}.modeling")
        eng.model = eng.runner.model = mod.build(eng.model, eng.config)
    return eng


@pytest.mark.parametrize("preset,target", [("k3-tiny", False), ("kimi-linear-tiny", True)])
def test_padded_decode_equals_eager_and_leaves_other_state_alone(preset, target):
    """3 and then 5 requests decode padded to buckets 4 and 8 (padding engine) or unpadded (enforce_eager): the
    same tokens, the same logits rows, and after every step the same pages and slots everywhere but the scratch
    page and slot, which only the padding engine writes."""
    prompts = random_prompts(7, [9, 17, 4, 5, 6])
    kw = dict(max_num_seqs=8, kv_cache_tokens=512, enable_prefix_caching=False)
    padded, eager = make(preset, target, **kw), make(preset, target, enforce_eager=True, **kw)
    assert padded.runner.padding and not eager.runner.padding
    recs = [_Recorder(padded), _Recorder(eager)]
    ids = [[], []]
    for i, e in enumerate((padded, eager)):
        for p in prompts[:3]:
            ids[i].append(e.add_request(p, greedy(5)))
    c = padded.cache
    real_pages, real_slots = list(range(c.num_pages)), list(range(c.num_slots + c.num_snapshots))
    scratch_before = _pool_state(eager.cache, [c.scratch_page], [c.scratch_slot])
    steps = 0
    while padded.has_unfinished() or eager.has_unfinished():
        if steps == 2:
            for i, e in enumerate((padded, eager)):
                for p in prompts[3:]:
                    ids[i].append(e.add_request(p, greedy(3)))
        padded.step()
        eager.step()
        steps += 1
        for a, b in zip(_pool_state(padded.cache, real_pages, real_slots),
                        _pool_state(eager.cache, real_pages, real_slots)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)     # fp32 GEMMs of another M: 1e-6 apart
    tokens = [[e.final_output(r).token_ids for r in rs] for e, rs in zip((padded, eager), ids)]
    assert tokens[0] == tokens[1]
    # the eager engine never touched the scratch page and slot; the padded one ran its padding rows there
    for a, b in zip(_pool_state(eager.cache, [c.scratch_page], [c.scratch_slot]), scratch_before):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in
               zip(_pool_state(padded.cache, [c.scratch_page], [c.scratch_slot]), scratch_before))
    layouts = [(n, pad) for n, pad, _ in recs[0].steps]
    assert (4, 1) in layouts and (8, 3) in layouts                 # 3 requests -> bucket 4, 5 -> bucket 8
    assert all(pad == 0 for _, pad, _ in recs[1].steps)
    assert len(recs[0].steps) == len(recs[1].steps)
    for (_, _, a), (_, _, b) in zip(recs[0].steps, recs[1].steps):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_padding_rows_touch_only_the_scratch_page_and_slot():
    """One padded decode step straight through the runner: every page and slot other than the live requests'
    and the scratch ones is bitwise unchanged (they hold random values, so a stray write would show)."""
    eng = make("kimi-linear-tiny", True, max_num_seqs=8, kv_cache_tokens=256, enable_prefix_caching=False)
    for p in random_prompts(3, [5, 8]):
        eng.add_request(p, greedy(4))
    eng.step()                                   # prefill both
    c = eng.cache
    live_pages = {p for r in eng.scheduler.running for p in r.pages}
    live_slots = {r.slot for r in eng.scheduler.running}
    pages = [p for p in range(c.num_pages) if p not in live_pages]
    slots = [s for s in range(c.num_slots + c.num_snapshots) if s not in live_slots]
    gen = torch.Generator().manual_seed(0)
    for t in c.pools.mla.values():
        t[pages] = torch.randn(t[pages].shape, generator=gen).to(t.dtype)
    for t in list(c.pools.conv.values()) + list(c.pools.recurrent.values()):
        t[slots] = torch.randn(t[slots].shape, generator=gen).to(t.dtype)
    before = _pool_state(c, pages, slots)
    reqs = list(eng.scheduler.running)
    batch = eng.inputs.fill([r.all_token_ids[-1] for r in reqs], [r.num_computed for r in reqs],
                            list(range(len(reqs) + 1)), [r.num_computed for r in reqs], [r.slot for r in reqs],
                            list(range(len(reqs))), c.block_tables, [])
    assert batch.num_reqs == 2 and batch.padded_rows == 0
    eng.inputs.fill_padding(8)                   # a whole bucket of padding rows
    batch = eng.inputs.decode_batch(8, c.block_tables)
    logits = eng.runner(batch)
    assert logits.shape[0] == 0 and batch.padded_rows == 8
    for a, b in zip(_pool_state(c, pages, slots), before):
        assert torch.equal(a, b)


def test_decode_step_plan_uploads_nothing(monkeypatch):
    """A decode step's StepPlan (and a single-wave mixed step's, from the runtime's inputs) is built from device
    buffers only: no host list is uploaded and nothing waits for the device."""
    eng = make_engine("kimi-linear-tiny", max_num_seqs=8, kv_cache_tokens=256, enable_prefix_caching=False)

    def forbidden(*a, **k):
        raise AssertionError("StepPlan uploaded a host list")

    monkeypatch.setattr(step_plan, "_upload", forbidden)
    monkeypatch.setattr(torch, "repeat_interleave", forbidden)
    c = eng.cache
    eng.inputs.fill_padding(4)
    batch = eng.inputs.decode_batch(4, c.block_tables)            # padding only: the static bucket batch
    plan = StepPlan(batch, c.page_size)
    assert plan.req_idx.data_ptr() == eng.inputs.arange32.data_ptr()
    assert plan.cu_q.data_ptr() == eng.inputs.arange32.data_ptr() and plan.num_splits == 1
    (rows, cu, slots, snaps, fla_cu), = plan.kda_waves
    assert fla_cu is None                                         # a decode step runs no chunked KDA
    assert rows is None and cu.tolist() == [0, 1, 2, 3, 4] and slots.tolist() == [c.scratch_slot] * 4
    monkeypatch.undo()
    reqs = [Request(f"r{i}", list(range(3, 23)), SamplingParams(), torch.Generator()) for i in range(2)]
    for r in reqs:
        assert c.acquire_slot(r) and c.grow(r, 20)
    c.flush_block_tables()
    batch = eng.inputs.fill(list(range(3, 23)) + [5], list(range(20)) + [7], [0, 20, 21], [0, 7],
                            [r.slot for r in reqs], [19, 20], c.block_tables, [])
    monkeypatch.setattr(step_plan, "_upload", forbidden)
    monkeypatch.setattr(torch, "repeat_interleave", forbidden)
    plan = StepPlan(batch, c.page_size)
    # MLA split: the decode row (20) stays absorbed; the 20-token prefill expands its own 20 context rows
    short, long = plan.mla_split
    assert plan.req_idx.tolist() == [0] * 20 + [1] and short.tolist() == [20] and long.tolist() == list(range(20))
    assert plan.cu_q_long.tolist() == [0, 20] and plan.cu_k.tolist() == [0, 20] and len(plan.ctx_rows) == 20
    # the chunked KDA's cumulative lengths for fla-core: int64 on the device and on the host, no read-back
    (_, cu, _, _, (cu_long, cu_host)), = plan.kda_waves
    assert cu_long.dtype == cu_host.dtype == torch.long and cu_host.device.type == "cpu"
    assert cu_long.tolist() == cu_host.tolist() == cu.tolist() == [0, 20, 21]
    monkeypatch.undo()
    # the same split from host lists (callers without the runtime's device tensors)
    import dataclasses
    host = StepPlan(dataclasses.replace(batch, req_idx=None, cu_seqlens_dev=None, cu_kv_dev=None), c.page_size)
    assert [t.tolist() for t in host.mla_split] == [short.tolist(), long.tolist()]
    assert host.cu_q_long.tolist() == [0, 20] and host.cu_k.tolist() == [0, 20]
    assert torch.equal(host.ctx_rows, plan.ctx_rows)


def test_fla_prefill_gets_the_waves_host_lengths(monkeypatch):
    """fla_chunk_prefill hands fla-core's chunk_kda the wave's own int64 tensors (`fla_cu`: the same objects for
    every layer of a step, so fla's identity-keyed cache derives the chunk indices once, on the host from the host
    copy), and without them falls back to an int64 copy and no host copy."""
    from kestrel.kernels.kda import fla_chunk
    seen = []

    def fake_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       cu_seqlens, cu_seqlens_cpu=None):
        seen.append((cu_seqlens, cu_seqlens_cpu))
        return torch.zeros_like(v), initial_state
    monkeypatch.setattr(fla_chunk, "import_chunk_kda", lambda device=None: fake_chunk_kda)
    T, H, D = 6, 2, 4
    q, k, v, g = (torch.randn(T, H, D) for _ in range(4))
    beta, state = torch.rand(T, H), torch.randn(3, H, D, D)
    cu, slots = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    fla_cu = (cu.long(), torch.tensor([0, 2, 6]))
    fla_chunk.fla_chunk_prefill(q, k, v, g, beta, state, cu, slots, fla_cu=fla_cu)
    fla_chunk.fla_chunk_prefill(q, k, v, g, beta, state, cu, slots)
    assert seen[0][0] is fla_cu[0] and seen[0][1] is fla_cu[1]
    assert seen[1][0].dtype == torch.long and seen[1][0].tolist() == [0, 2, 6] and seen[1][1] is None


@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_target_regroups_weights_without_a_second_copy(preset):
    """A target joins weights once at build and re-points the model's parameters at slices of the joined tensors:
    the router reads the checkpoint's tensor (MoeRouterBf16: no fp32 copy, no cast per call), Kimi Linear's shared
    expert is expert E of the stacked experts, and the distinct storages of model and target together hold no
    more than the weights plus the per-head kv_b halves of the absorbed MLA form (the build never doubles the
    experts: on Kimi Linear 48B they are 94 GB)."""
    eng = make_engine(preset, max_num_seqs=2, kv_cache_tokens=64)
    model, c = eng.model, eng.config

    def nbytes(tensors):
        seen = {}
        for t in tensors:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    before = nbytes(model.parameters())
    target = importlib.import_module(f"kestrel.models.kimi.targets.{TARGETS[preset]}.modeling").build(model, c)
    ptr = lambda t: t.untyped_storage().data_ptr()      # noqa: E731
    kv_b_bytes = 0
    for i, L in enumerate(target.layers):
        p = f"layers.{i}."
        if "router" in L:
            m = p + "block_sparse_moe."
            assert ptr(L["router"]) == ptr(model.get_parameter(m + "gate.weight"))
            if preset == "kimi-linear-tiny":
                assert L["shared_expert"] and L["w13"].shape[0] == c.num_experts + 1
                for name, key in (("experts.w13", "w13"), ("experts.w2", "w2"),
                                  ("shared_experts.gate_proj.weight", "w13"), ("shared_experts.down_proj.weight", "w2")):
                    assert ptr(model.get_parameter(m + name)) == ptr(L[key])
        a = p + "self_attn."
        first = "q_proj" if L["kind"] == "kda" or preset == "kimi-linear-tiny" else "q_a_proj"
        assert ptr(model.get_parameter(a + first + ".weight")) == ptr(L["in"])
        if L["kind"] == "mla":
            kv_b_bytes += L["kv_b"].numel() * L["kv_b"].element_size()
    held = [v for L in target.layers for v in L.values() if isinstance(v, torch.Tensor)]
    after = nbytes(list(model.parameters()) + held)
    # fp32 copies of small vectors (attention-residual queries, A_log, norms) are allowed a little slack
    assert after <= before + kv_b_bytes + 64 * 1024, (before, after, kv_b_bytes)


def test_block_table_flush_is_one_indexed_copy_of_changed_entries():
    """The device table (a separate tensor here, as on a GPU) follows the host mirror through grows, a long row
    and releases, by flushing only the entries that changed."""
    cfg = ModelConfig.from_dict(preset_config("kimi-linear-tiny"))
    c = HybridCache(cfg, 300, 4, 4, 0, 200, torch.float32, torch.device("cpu"), prefix_caching=False)
    c.block_tables = c.block_tables_host.clone()          # a device table apart from the mirror
    copies = []
    real = torch.Tensor.index_copy_

    def spy(self, dim, index, source):
        copies.append(index.numel())
        return real(self, dim, index, source)

    reqs = [Request(f"r{i}", [1] * 4, SamplingParams(), torch.Generator()) for i in range(3)]
    torch.Tensor.index_copy_ = spy
    try:
        for i, r in enumerate(reqs):
            assert c.acquire_slot(r) and c.grow(r, 4 * (1 + 60 * i))        # 1, 61 and 121 pages: long rows
        c.flush_block_tables()
        assert copies == [1 + 61 + 121]
        assert torch.equal(c.block_tables, c.block_tables_host)
        c.grow(reqs[0], 8)
        c.release(reqs[1])
        c.flush_block_tables()
        assert copies[1] == 1 + 61
        assert torch.equal(c.block_tables, c.block_tables_host)
        c.flush_block_tables()
        assert len(copies) == 2                                   # nothing changed: no copy
    finally:
        torch.Tensor.index_copy_ = real
    assert (c.block_tables_host[c.scratch_row] == c.scratch_page).all()


def test_runner_without_cuda_has_no_graphs():
    eng = make("kimi-linear-tiny", True, max_num_seqs=4, kv_cache_tokens=64)
    assert isinstance(eng.runner, ModelRunner) and not eng.runner.capturable and not eng.runner.graphs
    from kestrel.catalog._kimi_k3 import K3Forward       # the forward every K3 sm_90 target builds
    assert K3Forward.capturable is True
    eng.runner.capture(1 << 20)                                  # a no-op without CUDA
    assert not eng.runner.graphs


def test_warm_up_touches_only_the_scratch_page_and_free_slots():
    """The capture's eager warm-up (prefill, mixed and multi-prompt steps, which compile the kernels' variants on a
    GPU) puts each segment of a step on its own free slot, as serving does: segments sharing one slot would run as
    one-segment KDA waves and leave the many-segment kernel variants to compile on the serving path (the H200's
    first batch-64 run compiled two short-conv variants so). Pages but the scratch page and slots in use or holding
    snapshots are left as they were; the free slots it used are zero again, as a request acquiring one expects."""
    eng = make_engine("k3-tiny", max_num_seqs=40, kv_cache_tokens=512)
    c = eng.cache
    busy = [c.free_slots.popleft() for _ in range(2)]      # two slots held by (pretend) running requests
    gen = torch.Generator().manual_seed(1)
    for t in list(c.pools.mla.values()) + list(c.pools.conv.values()) + list(c.pools.recurrent.values()):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    free = list(c.free_slots)
    kept = busy + list(range(c.num_slots, c.num_slots + c.num_snapshots))
    pages = list(range(c.num_pages))
    before = _pool_state(c, pages, kept)
    scratch = _pool_state(c, [c.scratch_page], [c.scratch_slot])
    model, segments = eng.runner.model, []

    many_long = []

    def recording(batch, pools):
        segments.append((len(batch.slot_list), len(set(batch.slot_list))))
        cu = batch.cu_seqlens
        many_long.append(sum(cu[b + 1] - cu[b] > MAX_VERIFY for b in range(len(cu) - 1)))
        return model(batch, pools)
    eng.runner.model = recording
    eng.runner.warm_up()
    assert all(torch.equal(a, b) for a, b in zip(_pool_state(c, pages, kept), before))
    used = free[:max(n for n, d in segments if n == d)]
    assert all((t[used] == 0).all() for t in list(c.pools.conv.values()) + list(c.pools.recurrent.values()))
    assert not all(torch.equal(a, b) for a, b in zip(_pool_state(c, [c.scratch_page], [c.scratch_slot]), scratch))
    assert not set(busy) & set(c.free_slots) and len(c.free_slots) == len(free)
    # steps of 17-32 and of 33-38 segments (the per-segment blocks of 32 and 64), each on distinct slots, some of
    # them all long segments (MLA prefill's per-segment block counts those)
    distinct = {n for n, d in segments if n == d}
    assert distinct & set(range(17, 33)) and distinct & set(range(33, 39)), segments
    assert {17, 33} <= set(many_long), many_long


def test_compile_ahead_runs_the_capture_steps_and_zeroes_what_they_wrote():
    """`ModelRunner.compile_ahead`, the dry run of capture's eager steps (runtime/precompile.py; on a GPU it launches
    no Triton kernel and the torch ops between them write what they will): on the CPU the steps run for real. It runs
    the warm-up and one padding step per captured key, leaves every page but the scratch page and every slot but the
    free ones the warm-up used and the scratch slot as they were, and those it zeroes."""
    eng = make_engine("kimi-linear-tiny", max_num_seqs=4, kv_cache_tokens=256)     # the reference: interpreted
    # targets' warm-ups take minutes here; a target's decode variants are given to it as capture keys them
    c, runner = eng.cache, eng.runner
    gen = torch.Generator().manual_seed(2)
    for t in list(c.pools.mla.values()) + list(c.pools.conv.values()) + list(c.pools.recurrent.values()):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    free = list(c.free_slots)
    kept = list(range(c.num_slots, c.num_slots + c.num_snapshots))
    for s in free:                       # the warm-up zeroes the free slots it uses; zero the rest to compare
        c.pools.reset_slots([s])
    pages = list(range(c.num_pages))
    before = _pool_state(c, pages, kept + free)
    decode_rows = []

    class Recording:                     # the model, noting the size of every all-padding (a key's) batch
        decode_variant, decode_variants = staticmethod(decode_variant), staticmethod(decode_variants)

        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, batch, pools):
            if batch.padded_rows:
                decode_rows.append(batch.num_reqs)
            return self.model(batch, pools)
    runner.model = Recording(runner.model)
    runner.capturable = True             # what CUDA gives it; the steps are the same
    runner.compile_ahead(1024)
    keys, _ = runner._keys(1024)
    assert sorted(decode_rows) == sorted(n for n, *_ in keys), (keys, decode_rows)
    assert all(torch.equal(a, b) for a, b in zip(_pool_state(c, pages, kept + free), before))
    assert all(bool((t == 0).all()) for t in _pool_state(c, [c.scratch_page], [c.scratch_slot]))


def test_warm_up_steps_hold_no_more_segments_than_serving_can():
    """Without prefix-cache snapshots a request is one segment of a step, so the warm-up's steps stop at the requests
    a step can hold: more would compile nothing serving launches, and with fewer free slots than segments they ran
    one KDA wave a segment (at max_num_seqs 1 most of a 27-layer start-up)."""
    segments = {}
    for seqs in (1, 3):
        eng = make_engine("k3-tiny", max_num_seqs=seqs, kv_cache_tokens=512, enable_prefix_caching=False)
        model, seen = eng.runner.model, []

        def recording(batch, pools, model=model, seen=seen):
            seen.append(len(batch.slot_list))
            return model(batch, pools)
        eng.runner.model = recording
        eng.runner.warm_up()
        segments[seqs] = seen
    assert max(segments[1]) == 1 and max(segments[3]) == 3, segments
