"""The fused MoE decode chain as a target will compose it: MoeRouterBf16 -> MoePermuteSmall(shared=True) ->
MoeGroupedGemmGlu -> MoeGroupedGemm (w2) -> MoeCombine, with the shared expert stacked as expert E, equals today's
routed experts (MoeExperts) plus the separate shared-expert MLP; and K3's latent chain ending in
MoeCombineRmsNorm equals MoeExperts + AddRmsNorm. Tiny widths (the interpreter runs the Triton kernels on the CPU)."""

import torch

from kestrel.catalog._op import validating
from kestrel.catalog.gemm.linear import Linear
from kestrel.catalog.moe.combine import MoeCombine
from kestrel.catalog.moe.combine_norm import MoeCombineRmsNorm
from kestrel.catalog.moe.experts import MoeExperts
from kestrel.catalog.moe.glu import SiluGlu
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.grouped_gemm_glu import MoeGroupedGemmGlu
from kestrel.catalog.moe.permute_small import MoePermuteSmall
from kestrel.catalog.moe.router import MoeRouter
from kestrel.catalog.moe.router_bf16 import MoeRouterBf16
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, H, E, K, I = 5, 64, 8, 2, 32


def _rand(shape, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(DEVICE, torch.bfloat16)


def _close(a, b, what):
    scale = float(b.float().pow(2).mean().sqrt())
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=3e-2, atol=3e-2 * scale, msg=what)


def test_kimi_linear_chain_with_shared_expert_as_expert_e():
    gen = torch.Generator().manual_seed(0)
    x = _rand((T, H), gen)
    router = _rand((E, H), gen, H ** -0.5)
    bias = (torch.randn(E, generator=gen) * 0.05).to(DEVICE)
    w13, w2 = _rand((E, 2 * I, H), gen, 2 * H ** -0.5), _rand((E, H, I), gen, I ** -0.5)
    shared_gu, shared_down = _rand((2 * I, H), gen, 2 * H ** -0.5), _rand((H, I), gen, I ** -0.5)

    # today: router (fp32 casts), routed experts, the shared MLP, the add
    ids, weights = MoeRouter.raw_call(x, router, bias, K, routed_scaling_factor=2.446)
    today = MoeExperts.raw_call(x, w13, w2, ids, weights, "silu")
    today = today.add_(Linear.raw_call(SiluGlu.raw_call(Linear.raw_call(x, shared_gu)), shared_down))

    # fused: the shared expert stacked as expert E (the loader would allocate [E+1] and fill row E)
    w13_all = torch.cat([w13, shared_gu[None]]).contiguous()
    w2_all = torch.cat([w2, shared_down[None]]).contiguous()
    with validating(MoeRouterBf16), validating(MoePermuteSmall), validating(MoeGroupedGemmGlu), \
            validating(MoeGroupedGemm), validating(MoeCombine):
        ids2, weights2 = MoeRouterBf16.raw_call(x, router, bias, K, routed_scaling_factor=2.446)
        perm, w_all = MoePermuteSmall.raw_call(ids2, E, weights2, shared=True)
        h = MoeGroupedGemmGlu.raw_call(x, w13_all, perm.expert_offsets, perm.sorted_token_ids, "silu")
        y = MoeGroupedGemm.raw_call(h, w2_all, perm.expert_offsets)
        fused = MoeCombine.raw_call(y, w_all, perm.slot_to_sorted)
    assert torch.equal(ids2.sort(1).values.cpu(), ids.sort(1).values.cpu()), "router picked other experts"
    assert w_all.shape == (T, K + 1) and torch.equal(w_all[:, K].cpu(), torch.ones(T))
    _close(fused, today, "routed + shared expert output")


def test_k3_latent_chain_ends_in_combine_norm():
    gen = torch.Generator().manual_seed(1)
    z = _rand((T, H), gen)
    w13, w2 = _rand((E, 2 * I, H), gen, 2 * H ** -0.5), _rand((E, H, I), gen, I ** -0.5)
    norm_w = (1 + 0.1 * torch.randn(H, generator=gen)).to(DEVICE, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(DEVICE, torch.int32)
    weights = (torch.rand(T, K, generator=gen) + 0.1).to(DEVICE)

    today = MoeExperts.raw_call(z, w13, w2, ids, weights, "situ", 4.0, 25.0)
    today, _ = AddRmsNorm.raw_call(today, None, norm_w, 1e-5)

    with validating(MoePermuteSmall), validating(MoeGroupedGemmGlu), validating(MoeCombineRmsNorm):
        perm, _ = MoePermuteSmall.raw_call(ids, E)
        h = MoeGroupedGemmGlu.raw_call(z, w13, perm.expert_offsets, perm.sorted_token_ids, "situ", 4.0, 25.0)
        y = MoeGroupedGemm.raw_call(h, w2, perm.expert_offsets)
        fused = MoeCombineRmsNorm.raw_call(y, weights, perm.slot_to_sorted, norm_w, 1e-5)
    _close(fused, today, "latent experts + routed_expert_norm")
