"""The sigmoid MoE router in two launches on the checkpoint's bf16 weight: one cuBLAS GEMM with fp32 output
(bf16 products are exact in fp32, so this is the fp32 GEMM up to summation order) and the top-k kernel.

MoeRouter computes `x.float() @ W.float().t()`: two casts (the weight's every call unless it is kept in fp32,
which doubles its bytes; K3: 25.7 MB a layer) and an fp32 GEMM. Here the GEMM reads bf16 x and W directly."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.moe._common import randn
from kestrel.catalog.moe.router import MoeRouter, Routed
from kestrel.kernels.moe.router import SMALL_T, router_logits_small, router_topk
from kestrel.ops.moe import route


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E] = x @ weight^T with fp32 accumulation and output: on CUDA the many-program GEMV for batch-1
    decode (cuBLAS runs it on 4 CTAs) and one GEMM beyond (torch.mm's out_dtype), an fp32 matmul elsewhere (no
    bf16 -> fp32 GEMM kernel on the CPU)."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        if x.shape[0] <= SMALL_T:
            return router_logits_small(x, weight)
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return torch.mm(x.float(), weight.float().t())


class MoeRouterBf16(OpWrapper):
    """MoeRouter's contract (same arguments, outputs and tolerance) with the router weight in the model dtype:
    logits = x @ W^T accumulated and returned in fp32 by one GEMM; then kestrel/kernels/moe/router.py's top-k
    (sigmoid, biased choice, unbiased weights, renormalize, scale). Returns (topk_ids int32 [T, k],
    topk_weights fp32 [T, k])."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = MoeRouter.TOLERANCE
    WIDTHS = MoeRouter.WIDTHS
    CELLS = (
        tiny("unit: bf16 weight, 6 tokens, 8 experts, top-2", T=6, H=64, E=8, k=2, scale=2.446),
        tiny("unit: bf16 weight, 5 tokens, 32 experts, top-4, no renorm", T=5, H=64, E=32, k=4, norm=False,
             scale=2.5),
        gpu("Kimi Linear 48B decode bs1 (router_logits_small): 256 experts top-8, hidden 2304, bf16 router weight",
            T=1, H=2304, E=256, k=8, scale=2.446),
        gpu("Kimi Linear 48B decode bs64: 256 experts top-8, bf16 router weight", T=64, H=2304, E=256, k=8,
            scale=2.446),
        gpu("Kimi Linear 48B prefill 8192: 256 experts top-8, bf16 router weight", T=8192, H=2304, E=256, k=8,
            scale=2.446),
        gpu("K3 decode bs1: 896 experts top-16, hidden 7168, one group, renormalized, bf16 router weight", T=1,
            H=7168, E=896, k=16, scale=1.0),
        gpu("K3 decode bs64: 896 experts top-16, bf16 router weight", T=64, H=7168, E=896, k=16, scale=1.0),
        gpu("K3 prefill 8192: 896 experts top-16, bf16 router weight", T=8192, H=7168, E=896, k=16, scale=1.0),
    )

    @staticmethod
    def raw_call(x, weight, e_score_correction_bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
                 routed_scaling_factor=1.0, out_ids=None, out_weights=None):
        return router_topk(router_logits(x, weight), e_score_correction_bias, top_k, n_group, topk_group,
                           norm_topk_prob, routed_scaling_factor, out_ids=out_ids, out_weights=out_weights)

    @staticmethod
    def reference(x, weight, e_score_correction_bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=1.0, out_ids=None, out_weights=None):
        return Routed(*route(x, weight, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                             routed_scaling_factor))

    @staticmethod
    def widths(x, weight, e_score_correction_bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
               routed_scaling_factor=1.0, out_ids=None, out_weights=None):
        return MoeRouter.widths(x, weight, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob)

    @classmethod
    def cell_widths(cls, spec):
        return MoeRouter.cell_widths(spec)

    @staticmethod
    def is_valid(x, weight, e_score_correction_bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
                 routed_scaling_factor=1.0, out_ids=None, out_weights=None):
        if weight.dtype != x.dtype:
            return f"weight dtype {weight.dtype} must be x's ({x.dtype}): this entry keeps the checkpoint's weight"
        return MoeRouter.is_valid(x, weight, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                                  routed_scaling_factor, out_ids, out_weights)

    @staticmethod
    def compare(out, ref):
        MoeRouter.compare(out, ref)

    @staticmethod
    def make_inputs(spec, device, generator):
        inp = MoeRouter.make_inputs(spec, device, generator)
        inp["weight"] = randn(inp["weight"].shape, generator, device, torch.bfloat16, scale=spec["H"] ** -0.5)
        return inp
