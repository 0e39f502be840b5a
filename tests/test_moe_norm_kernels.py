"""Targeted tests of the MoE / norm / activation kernels beyond the generic cell driver: router ties and grouped
top-k, the permutation's inverse map, experts that receive no tokens, the in-place residual update."""

import pytest
import torch

from kestrel.catalog._op import InvalidInput, validating
from kestrel.catalog.moe.experts import MoeExperts
from kestrel.catalog.moe.glu import SituGlu
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.permute import MoePermute, permute_reference
from kestrel.catalog.moe.router import MoeRouter
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
from kestrel.catalog.norm.attn_res_mix import AttnResMix
from kestrel.kernels.moe.router import router_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- router

def test_router_ties_pick_lowest_index_and_pass_compare():
    """Experts 1, 2, 5, 6 share one score; top-3 must take the clear best (expert 4) and then two of the tied
    ones: the kernel takes the lowest indices, and compare accepts any tie-broken choice."""
    H, E, k = 16, 8, 3
    g = gen(1)
    base = torch.randn(E, H, generator=g) * 0.1
    base[[1, 2, 5, 6]] = base[1] + 0.5            # identical rows -> bit-identical logits
    base[4] = base[1] + 2.0                        # clearly best
    x = torch.randn(4, H, generator=g).abs().to(torch.bfloat16)
    inputs = dict(x=x.to(DEVICE), weight=base.to(DEVICE), e_score_correction_bias=None, top_k=k,
                  routed_scaling_factor=2.446)
    with validating(MoeRouter):
        ids, w = MoeRouter.raw_call(**inputs)
    ref = MoeRouter.reference(**inputs)
    MoeRouter.compare((ids, w), ref)
    ids = ids.cpu()
    assert ids[:, 0].tolist() == [4] * 4
    assert sorted(ids[0, 1:].tolist()) == [1, 2]
    torch.testing.assert_close(w.sum(-1).cpu(), torch.full((4,), 2.446), rtol=1e-6, atol=1e-6)
    # a genuinely different set is refused
    bad = ids.clone()
    bad[0, 1] = 0
    with pytest.raises(AssertionError):
        MoeRouter.compare((bad.to(DEVICE), w), ref)


def test_router_grouped_topk_masks_weak_groups():
    """Group 0 holds the single best expert but a weak second one; with 4 groups of 2 and topk_group 2 the
    routing keeps groups 1 and 2 (best two-expert sums) and never picks expert 0."""
    p = torch.tensor([[0.99, 0.01, 0.70, 0.60, 0.58, 0.56, 0.50, 0.45]])
    logits = torch.log(p / (1 - p)).to(DEVICE)
    ids, w = router_topk(logits, None, top_k=2, n_group=4, topk_group=2, norm_topk_prob=True)
    assert sorted(ids.cpu()[0].tolist()) == [2, 3]
    torch.testing.assert_close(w.cpu()[0], torch.tensor([0.7, 0.6]) / 1.3, rtol=1e-5, atol=1e-6)
    ids, _ = router_topk(logits, None, top_k=2)                      # ungrouped: expert 0 wins
    assert sorted(ids.cpu()[0].tolist()) == [0, 2]


@pytest.mark.parametrize("E,n_group,topk_group,k", [(24, 4, 2, 5), (24, 3, 1, 2), (16, 1, 1, 16)])
def test_router_grouped_random_matches_reference(E, n_group, topk_group, k):
    """Groups whose size is not a power of two (6 of 24) and the k == E edge."""
    g = gen(E + k)
    inputs = dict(x=torch.randn(9, 32, generator=g).to(torch.bfloat16).to(DEVICE),
                  weight=(torch.randn(E, 32, generator=g) / 32 ** 0.5).to(DEVICE),
                  e_score_correction_bias=(torch.randn(E, generator=g) * 0.05).to(DEVICE), top_k=k,
                  n_group=n_group, topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5)
    with validating(MoeRouter):
        out = MoeRouter.raw_call(**inputs)
    MoeRouter.compare(out, MoeRouter.reference(**inputs))


def test_router_rejects_topk_beyond_kept_groups():
    inputs = dict(x=torch.randn(2, 8).to(torch.bfloat16), weight=torch.randn(8, 8), e_score_correction_bias=None,
                  top_k=5, n_group=4, topk_group=2)
    assert MoeRouter.is_valid(**inputs) is not None


# ---------------------------------------------------------------- permutation

@pytest.mark.parametrize("T,E,k", [(0, 8, 2), (3, 8, 2), (20, 896, 16)])
def test_permute_inverse_round_trip(T, E, k):
    g = gen(T)
    ids = torch.rand(T, E, generator=g).topk(k, dim=-1).indices.to(torch.int32).to(DEVICE) if T else \
        torch.empty((0, k), dtype=torch.int32, device=DEVICE)
    with validating(MoePermute):
        perm = MoePermute.raw_call(ids, E)
    MoePermute.compare(perm, permute_reference(ids, E))
    S = T * k
    pos, slots = perm.slot_to_sorted.long().cpu(), perm.sorted_slot_ids.long().cpu()
    assert torch.equal(slots[pos], torch.arange(S)) and torch.equal(pos[slots], torch.arange(S))
    assert torch.equal(perm.sorted_token_ids.long().cpu(), slots // k)
    offs = perm.expert_offsets.long().cpu()
    assert offs[0] == 0 and offs[-1] == S
    flat = ids.reshape(-1).long().cpu()
    for e in range(E):
        rows = slots[offs[e]:offs[e + 1]]
        assert (flat[rows] == e).all() and (rows[1:] > rows[:-1]).all()     # grouped, stable


# ---------------------------------------------------------------- grouped GEMM / experts

def _experts_inputs(ids, E, H=64, I=32, act="silu", seed=0):
    g = gen(seed)
    T, k = ids.shape
    w = torch.rand(T, k, generator=g) + 0.1
    return dict(x=torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEVICE),
                w13=(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(DEVICE),
                w2=(torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16).to(DEVICE),
                topk_ids=ids.to(torch.int32).to(DEVICE), topk_weights=(w / w.sum(-1, keepdim=True)).to(DEVICE),
                act=act, beta=4.0, linear_beta=25.0)


def test_experts_with_empty_experts_and_multi_tile_experts():
    """Only experts 1 and 5 of 8 get tokens; each gets 20 rows (> one 16-row tile under the interpreter)."""
    ids = torch.tensor([[1, 5]] * 20)
    inputs = _experts_inputs(ids, E=8)
    with validating(MoeExperts):
        out = MoeExperts.raw_call(**inputs)
    MoeExperts.compare(out, MoeExperts.reference(**inputs))


def test_experts_single_token_situ():
    ids = torch.tensor([[7, 0]])
    inputs = _experts_inputs(ids, E=8, act="situ", seed=3)
    with validating(MoeExperts):
        out = MoeExperts.raw_call(**inputs)
    MoeExperts.compare(out, MoeExperts.reference(**inputs))


def test_grouped_gemm_empty_experts_leave_no_rows_behind():
    """All rows on expert 6; the other experts' tiles must not write (the output starts as NaN)."""
    ids = torch.full((5, 1), 6, dtype=torch.int32)
    perm = permute_reference(ids, 8)
    g = gen(5)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(8, 32, 64, generator=g) / 8).to(torch.bfloat16).to(DEVICE)
    out = torch.full((5, 32), float("nan"), dtype=torch.float32, device=DEVICE)
    inputs = dict(x=x, w=w, expert_offsets=perm.expert_offsets.to(DEVICE),
                  sorted_token_ids=perm.sorted_token_ids.to(DEVICE), out=out)
    with validating(MoeGroupedGemm):
        y = MoeGroupedGemm.raw_call(**inputs)
    assert y is out
    MoeGroupedGemm.compare(y, MoeGroupedGemm.reference(**{**inputs, "out": torch.empty_like(out)}))


@pytest.mark.parametrize("tma", ["off", "on", "persistent"])
@pytest.mark.parametrize("gather", [True, False])
def test_grouped_gemm_half_height_tail_tiles(monkeypatch, gather, tma):
    """Experts whose last tile holds at most half a tile's rows run it as a half-height tile (prefill's 128-row
    tiles; here 32-row tiles so the interpreter runs both heights): rows per expert 0, 5, 16 (exactly half), 17, 40
    (a full tile and an 8-row tail), 64 (two full tiles); every row equals the reference and no other is written.
    The TMA kernels too (the persistent one runs no half-height tiles; its full tiles still must not write the next
    expert's rows)."""
    import kestrel.kernels.moe.grouped_gemm as gg
    monkeypatch.setattr(gg, "TMA", tma)
    calls = _spy_tma(monkeypatch)
    bm = 32 if DEVICE == "cpu" else 128
    monkeypatch.setattr(gg, "_config", lambda *_: (bm, 32, 32, 4, 1) if DEVICE == "cpu" else (bm, 64, 64, 8, 3))
    monkeypatch.setattr(gg, "TAIL_MIN_BM", bm)
    scale = bm // 32
    counts = [0, 5 * scale, 16 * scale, 17 * scale, 40 * scale, 64 * scale]
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen(8))][:, None]
    perm = permute_reference(ids, len(counts))
    g = gen(9)
    S, K, N = ids.numel(), 96, 64
    x = torch.randn(S, K, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(len(counts), N, K, generator=g) / 8).to(torch.bfloat16).to(DEVICE)
    out = torch.full((S, N), float("nan"), dtype=torch.float32, device=DEVICE)
    inputs = dict(x=x, w=w, expert_offsets=perm.expert_offsets.to(DEVICE),
                  sorted_token_ids=perm.sorted_token_ids.to(DEVICE) if gather else None, out=out)
    with validating(MoeGroupedGemm):
        y = MoeGroupedGemm.raw_call(**inputs)
    assert not y.isnan().any() and bool(calls) == (tma != "off")
    MoeGroupedGemm.compare(y, MoeGroupedGemm.reference(**{**inputs, "out": torch.empty_like(out)}))


def _spy_tma(monkeypatch):
    """Count the launches that take grouped_gemm's TMA path."""
    import kestrel.kernels.moe.grouped_gemm as gg
    calls = []
    real = gg._grouped_gemm_tma
    monkeypatch.setattr(gg, "_grouped_gemm_tma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _cells_here():
    from kestrel.catalog._op import current_arch
    arch = current_arch(DEVICE)
    return [pytest.param(c, id=f"cell{i}") for i, c in enumerate(MoeGroupedGemm.CELLS) if arch in c.archs]


@pytest.mark.parametrize("tma", ["on", "persistent"])
@pytest.mark.parametrize("cell", _cells_here())
def test_grouped_gemm_tma_cells(monkeypatch, cell, tma):
    """The TMA kernels (weights, and the second GEMM's rows, through tensor descriptors; the interpreter runs them
    too) on every cell the catalog certifies here: ragged N and K % BK != 0 (the descriptors' zero padding), empty
    experts, fp32 output, and on the GPU the Kimi Linear / K3 decode and prefill widths."""
    import zlib

    import kestrel.kernels.moe.grouped_gemm as gg
    from kestrel.catalog._op import run_cell
    monkeypatch.setattr(gg, "TMA", tma)
    calls = _spy_tma(monkeypatch)
    run_cell(MoeGroupedGemm, cell, DEVICE, seed=zlib.crc32(cell.why.encode()) % 1000)
    assert calls, "the TMA path did not run"


def test_grouped_gemm_tma_refuses_unaligned_rows(monkeypatch):
    """K = 36 bf16 is a 72-byte row pitch, which a TMA descriptor cannot describe (16-byte multiples): the pointer
    kernel answers instead, and correctly."""
    import kestrel.kernels.moe.grouped_gemm as gg
    monkeypatch.setattr(gg, "TMA", "on")
    calls = _spy_tma(monkeypatch)
    perm = permute_reference(torch.tensor([[0, 2], [1, 2], [2, 0]], dtype=torch.int32), 3)
    g = gen(11)
    x = torch.randn(3, 36, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(3, 24, 36, generator=g) / 6).to(torch.bfloat16).to(DEVICE)
    inputs = dict(x=x, w=w, expert_offsets=perm.expert_offsets.to(DEVICE),
                  sorted_token_ids=perm.sorted_token_ids.to(DEVICE))
    with validating(MoeGroupedGemm):
        y = MoeGroupedGemm.raw_call(**inputs)
    assert not calls
    MoeGroupedGemm.compare(y, MoeGroupedGemm.reference(**inputs))


@pytest.mark.skipif(DEVICE != "cuda", reason="the descriptors' Hopper code paths")
@pytest.mark.parametrize("variant", ["on", "on-split", "persistent", "persistent-split", "persistent-noflat"])
@pytest.mark.parametrize("gather", [True, False])
def test_grouped_gemm_tma_kimi_linear_prefill(monkeypatch, gather, variant):
    """Every TMA form the sweep (benchmarks/moe_gemm_sweep.py --variants) times, at an 8K-token Kimi Linear
    prefill (65,536 rows over 256 experts; w13 2304 -> 2048 gathered, w2 1024 -> 2304 contiguous) and the host's
    prefill config: equal to the fp32 reference, every row written."""
    import kestrel.kernels.moe.grouped_gemm as gg
    mode, _, knob = variant.partition("-")
    monkeypatch.setattr(gg, "EPILOGUE_SPLIT", knob == "split")
    monkeypatch.setattr(gg, "PERSISTENT_FLATTEN", knob != "noflat")
    calls = _spy_tma(monkeypatch)
    T, E, k = 8192, 256, 8
    N, K = (2048, 2304) if gather else (2304, 1024)
    g = gen(12)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
    perm = permute_reference(ids, E)
    x = torch.randn(T if gather else T * k, K, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(E, N, K, generator=g) * K ** -0.5).to(torch.bfloat16).to(DEVICE)
    offs, rows = perm.expert_offsets.to(DEVICE), perm.sorted_token_ids.to(DEVICE) if gather else None
    out = torch.full((T * k, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y = gg.grouped_gemm(x, w, offs, sorted_token_ids=rows, out=out, tma=mode)
    assert calls and not y.isnan().any()
    MoeGroupedGemm.compare(y, MoeGroupedGemm.reference(x, w, offs, rows))


# ---------------------------------------------------------------- norms / activation

def test_add_rmsnorm_updates_residual_in_place_on_strided_rows():
    g = gen(7)
    big = torch.randn(6, 160, generator=g).to(torch.bfloat16).to(DEVICE)
    x = big[:, 16:144]                                  # row stride 160, last dim contiguous
    residual = (torch.randn(6, 128, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16).to(DEVICE)
    x_before, res_before = x.clone(), residual.clone()
    with validating(AddRmsNorm):
        y, r = AddRmsNorm.raw_call(x, residual, weight, 1e-5)
    assert r is residual and r.data_ptr() == residual.data_ptr()
    assert torch.equal(x, x_before)                      # x untouched
    expected_r = (x_before.float() + res_before.float()).to(torch.bfloat16)
    assert torch.equal(residual, expected_r)            # bit for bit torch's bf16 add
    y_ref, _ = AddRmsNorm.reference(x_before, res_before.clone(), weight, 1e-5)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=1e-2, atol=1e-2)
    # without residual: r is x itself and nothing is written into x
    y2, r2 = AddRmsNorm.raw_call(x, None, weight, 1e-5)
    assert r2 is x and torch.equal(x, x_before)


def test_add_rmsnorm_refuses_aliasing():
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    with validating(AddRmsNorm), pytest.raises(InvalidInput):
        AddRmsNorm.raw_call(x, x, w, 1e-5)
    with validating(AddRmsNorm), pytest.raises(InvalidInput):
        AddRmsNorm.raw_call(x, None, w, 1e-5, out=x)


def test_attn_res_mix_without_blocks_is_partial():
    p = torch.randn(3, 96, generator=gen(2)).to(torch.bfloat16).to(DEVICE)
    blocks = torch.empty((0, 3, 96), dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(96, generator=gen(3)).to(DEVICE)
    with validating(AttnResMix):
        out = AttnResMix.raw_call(blocks, p, w, 1e-6)
    assert torch.equal(out, p)


def test_situ_small_and_large_inputs_fp32():
    """tanh near 0 (u / 25 ~ 1e-5: the Taylor branch) and saturation (|g| ~ 100)."""
    g = torch.tensor([[1e-4, -3e-4, 100.0, -100.0, 2.0, -0.3, 0.5, 80.0]])
    u = torch.tensor([[2e-4, -1e-3, 1e-4, 300.0, -400.0, 0.7, 3.1, 1e-6]])
    gu = torch.cat([g, u], dim=1).to(DEVICE)
    out = SituGlu.raw_call(gu, 4.0, 25.0)
    ref = SituGlu.reference(gu, 4.0, 25.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-12)
