"""Reduce-scatter along the leading (row) dim: rank r keeps the sum over ranks of rows r*T:(r+1)*T."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.comm._group import (cell_group, comm_ok, compare_sum, fp32_sum, gather_exact, out_ok,
                                         rank_randn, reduce_scatter_single, result, row_width)


class ReduceScatter(OpWrapper):
    """out [T, ...] = sum over the group's ranks of their x[rank*T:(rank+1)*T] (x [R*T, ...]): the all-reduce's
    first half, where each rank needs only its own rows next (DP attention after a TP MoE, sequence-parallel
    prefill). The backend adds in x's dtype; the reference in fp32, rank 0 first, rounded once. Returns out."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "see _group.compare_sum: R-1 adds in x's dtype -> bf16 rtol 2^-6, atol 2^-6 * rms(sum); fp32 1e-5"
    WIDTHS = ("N", "dtype")
    CELLS = (
        tiny("unit: 3 rows x 64 bf16 kept per rank", T=3, N=64, dtype=torch.bfloat16),
        tiny("unit: fp32, width not a power of two", T=2, N=72, dtype=torch.float32),
        gpu("K3 dep16 decode bs64 per rank: MoE output rows back to their DP rank, hidden 7168", T=64, N=7168,
            dtype=torch.bfloat16),
        gpu("K3 helix16 decode bs64: o_proj partial sums scattered by token before the FFN, hidden 7168", T=4,
            N=7168, dtype=torch.bfloat16),
        gpu("K3 tp8 prefill chunk 8192: sequence-parallel o_proj output, 1024 tokens per rank, hidden 7168",
            T=1024, N=7168, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B dep2 / dep4 decode bs64 per rank: MoE output rows, hidden 2304", T=64, N=2304,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp2 prefill chunk 8192: sequence-parallel o_proj output, hidden 2304", T=4096,
            N=2304, dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, group, out=None):
        if out is None:
            out = torch.empty((x.shape[0] // group.size(), *x.shape[1:]), dtype=x.dtype, device=x.device)
        reduce_scatter_single(out, x, group=group)
        return out

    @staticmethod
    def reference(x, group, out=None):
        T, r = x.shape[0] // group.size(), group.rank()
        return result(x, out, (T, *x.shape[1:]), lambda: fp32_sum(gather_exact(x, group))[r * T:(r + 1) * T])

    @staticmethod
    def widths(x, group, out=None):
        return {"N": row_width(x), "dtype": x.dtype}

    @staticmethod
    def is_valid(x, group, out=None):
        why = comm_ok(x, "x", group)
        if why:
            return why
        R = group.size()
        if x.shape[0] % R:
            return f"x has {x.shape[0]} rows, not a multiple of the group's {R} ranks"
        return out_ok(out, x, (x.shape[0] // R, *x.shape[1:]))

    @staticmethod
    def compare(out, ref):
        compare_sum(out, ref, "ReduceScatter")

    @staticmethod
    def make_inputs(spec, device, generator):
        group = cell_group(device)
        rows = group.size() * spec["T"]
        return dict(x=rank_randn((rows, spec["N"]), generator, group, device, spec["dtype"]), group=group)
