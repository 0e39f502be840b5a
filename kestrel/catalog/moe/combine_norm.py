"""K3 latent MoE: the routing-weighted combine of each token's expert rows fused with `routed_expert_norm`
(MoeCombine + AddRmsNorm -> one launch)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn
from kestrel.catalog.moe.combine import MoeCombine
from kestrel.kernels.moe.combine_norm import MAX_N, moe_combine_rmsnorm
from kestrel.ops.norm import rms_norm


class MoeCombineRmsNorm(OpWrapper):
    """raw_call(y [S, N] sorted expert rows, topk_weights fp32 [T, k], slot_to_sorted int32 [T*k], norm_weight [N],
    eps, out=None) -> [T, N] in y's dtype = AddRmsNorm(MoeCombine(y, topk_weights, slot_to_sorted), None,
    norm_weight, eps): the combined row rounded once to y's dtype (as MoeCombine stores it), then normalized in
    fp32. Triton kernel: kestrel/kernels/moe/combine_norm.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("fp32 sum of k<=16 rows (reassociation ~1e-6 rel can flip the combined row's bf16 rounding, "
                 "2^-8) then the norm's fp32 math and one bf16 rounding of the output: rtol 2e-2, atol 2e-2 at "
                 "|out| ~ 1; fp32: 1e-5")
    WIDTHS = ("k", "N", "dtype")
    CELLS = (
        tiny("unit: 5 tokens, top-2, N=64", T=5, k=2, N=64, dtype=torch.bfloat16),
        tiny("unit: fp32, top-16 as K3, N not a power of two", T=3, k=16, N=96, dtype=torch.float32),
        gpu("K3 latent MoE decode bs1: top-16 rows of latent 3584 + routed_expert_norm", T=1, k=16, N=3584,
            dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs64: top-16 x 3584 + norm", T=64, k=16, N=3584, dtype=torch.bfloat16),
        gpu("K3 latent MoE decode bs256: top-16 x 3584 + norm", T=256, k=16, N=3584, dtype=torch.bfloat16),
        gpu("K3 latent MoE prefill 8192: top-16 x 3584 + norm", T=8192, k=16, N=3584, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(y, topk_weights, slot_to_sorted, norm_weight, eps, out=None):
        return moe_combine_rmsnorm(y, topk_weights, slot_to_sorted, norm_weight, eps, out=out)

    @staticmethod
    def reference(y, topk_weights, slot_to_sorted, norm_weight, eps, out=None):
        c = MoeCombine.reference(y, topk_weights, slot_to_sorted)        # rounded to y's dtype
        res = rms_norm(c, norm_weight, eps).to(y.dtype)
        if out is not None:
            res = out.copy_(res)
        return res

    @staticmethod
    def widths(y, topk_weights, slot_to_sorted, norm_weight, eps, out=None):
        return {"k": topk_weights.shape[1], "N": y.shape[1], "dtype": y.dtype}

    @staticmethod
    def is_valid(y, topk_weights, slot_to_sorted, norm_weight, eps, out=None):
        why = MoeCombine.is_valid(y, topk_weights, slot_to_sorted, out)
        if why:
            return why
        N = y.shape[1]
        if N > MAX_N:
            return f"N={N} > {MAX_N}: the kernel holds a row in registers"
        if norm_weight.shape != (N,) or not norm_weight.is_contiguous() or norm_weight.device != y.device:
            return f"norm_weight must be a contiguous [{N}] tensor on y's device"
        if out is not None and overlaps(out, norm_weight):
            return "out overlaps norm_weight"
        if not eps > 0:
            return f"eps must be > 0, got {eps}"
        return None

    @staticmethod
    def compare(out, ref):
        tol = 1e-5 if ref.dtype == torch.float32 else 2e-2
        assert_close(out, ref, rtol=tol, atol=tol, what="MoeCombineRmsNorm")

    @staticmethod
    def make_inputs(spec, device, generator):
        inp = MoeCombine.make_inputs(spec, device, generator)
        inp["norm_weight"] = randn((spec["N"],), generator, device, spec["dtype"], scale=0.1, shift=1.0)
        inp["eps"] = 1e-5
        return inp
