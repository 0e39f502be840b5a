"""All-reduce of a TP layer's partial output, then the residual add and RMSNorm of the next sub-layer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.comm._group import cell_group, comm_ok, compare_sum, fp32_sum, gather_exact, rank_randn
from kestrel.catalog.moe._common import randn
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm


class AllReduceAddRmsNorm(OpWrapper):
    """x <- sum over ranks of x (the all-reduce, in x's dtype, in place), then r = residual + x (rounded once to
    residual's dtype, written into `residual`), y = weight * r * rsqrt(mean(r^2) + eps) in fp32, cast to x's dtype.
    Returns (y, r) as AddRmsNorm does. Today it is that composition: NCCL's (or gloo's) all-reduce, then the
    AddRmsNorm kernel; one entry, so a one-shot kernel fusing the three can replace it where it measurably beats
    NCCL on the GPU run without a target changing."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("x: the all-reduce's bound (_group.compare_sum); r: one add of the bf16 sum, rtol/atol 2^-6 * "
                 "rms like the sum it holds; y: AddRmsNorm's 1e-2 plus the sum's 2^-6 relative -> 3e-2 (fp32 1e-5)")
    WIDTHS = ("N", "dtype")
    CELLS = (
        tiny("unit: 5 tokens x 64 bf16: reduce, add, norm", T=5, N=64, dtype=torch.bfloat16),
        tiny("unit: fp32, width not a power of two", T=3, N=96, dtype=torch.float32),
        gpu("K3 tp8 decode bs1: o_proj all-reduce + residual + post-attention norm, hidden 7168", T=1, N=7168,
            dtype=torch.bfloat16),
        gpu("K3 tp8 decode bs64: o_proj / MoE all-reduce + residual + next norm, hidden 7168", T=64, N=7168,
            dtype=torch.bfloat16),
        gpu("K3 tp8 prefill chunk 8192: all-reduce + residual + norm, hidden 7168", T=8192, N=7168,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp2 / tp4 decode bs1: all-reduce + residual + norm, hidden 2304", T=1, N=2304,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp2 / tp4 decode bs64: all-reduce + residual + norm, hidden 2304", T=64, N=2304,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp2 prefill chunk 8192: all-reduce + residual + norm, hidden 2304", T=8192, N=2304,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, residual, weight, eps, group, out=None):
        dist.all_reduce(x, group=group)
        return AddRmsNorm.raw_call(x, residual, weight, eps, out=out)

    @staticmethod
    def reference(x, residual, weight, eps, group, out=None):
        if not x.is_meta:
            x.copy_(fp32_sum(gather_exact(x, group)).to(x.dtype))
        return AddRmsNorm.reference(x, residual, weight, eps, out=out)

    @staticmethod
    def widths(x, residual, weight, eps, group, out=None):
        return {"N": x.shape[-1], "dtype": x.dtype}

    @staticmethod
    def is_valid(x, residual, weight, eps, group, out=None):
        why = comm_ok(x, "x", group)
        if why:
            return why
        if x.dim() != 2:
            return f"x must be [T, N], got {tuple(x.shape)}"
        if residual is None:
            return "residual is required (a norm without one follows no all-reduce)"
        if overlaps(x, residual):
            return "x and residual overlap: both are written in place"
        return AddRmsNorm.is_valid(x, residual, weight, eps, out)

    @staticmethod
    def compare(out, ref):
        (y, r), (y_ref, r_ref) = out, ref
        compare_sum(r, r_ref, "AllReduceAddRmsNorm r")
        tol = 1e-5 if y_ref.dtype == torch.float32 else 3e-2
        assert_close(y, y_ref, rtol=tol, atol=tol, what="AllReduceAddRmsNorm y")

    @staticmethod
    def make_inputs(spec, device, generator):
        group = cell_group(device)
        T, N, dtype = spec["T"], spec["N"], spec["dtype"]
        return dict(x=rank_randn((T, N), generator, group, device, dtype),
                    residual=randn((T, N), generator, device, dtype, scale=4.0),
                    weight=randn((N,), generator, device, dtype, scale=0.1, shift=1.0), eps=1e-5, group=group)
