"""All-gather along the leading (row) dim: rank r's rows land at out[r*T:(r+1)*T] on every rank."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.comm._group import (all_gather_single, cell_group, comm_ok, gather_exact, out_ok, rank_randn,
                                         result, row_width)


class AllGather(OpWrapper):
    """out [R*T, ...] = the ranks' x [T, ...] stacked in rank order (pure data movement: exact). Gathering along
    another dim (a vocab-parallel lm_head's [T, V/R] logits) is this gather into [R, T, V/R] and a view the
    caller permutes. Returns out (allocated when None)."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "exact: a copy of every rank's rows"
    WIDTHS = ("N", "dtype")
    CELLS = (
        tiny("unit: 4 rows x 48 bf16 per rank", T=4, N=48, dtype=torch.bfloat16),
        tiny("unit: fp32, one row per rank", T=1, N=80, dtype=torch.float32),
        gpu("K3 tp8 decode bs1: vocab-parallel lm_head logits, 163840 / 8 per rank (fp32)", T=1, N=20480,
            dtype=torch.float32),
        gpu("K3 tp8 decode bs64: vocab-parallel lm_head logits, 163840 / 8 per rank (fp32)", T=64, N=20480,
            dtype=torch.float32),
        gpu("K3 dep16 decode bs64 per rank: hidden rows gathered before a TP MoE / lm_head, hidden 7168", T=64,
            N=7168, dtype=torch.bfloat16),
        gpu("K3 helix16 decode bs64: o_proj input heads 96 / 16 x 128 gathered back per token", T=64, N=768,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp2 decode bs64: vocab-parallel lm_head logits, 163840 / 2 per rank (fp32)", T=64,
            N=81920, dtype=torch.float32),
        gpu("Kimi Linear 48B dep2 / dep4 decode bs64 per rank: hidden rows, hidden 2304", T=64, N=2304,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, group, out=None):
        if out is None:
            out = torch.empty((group.size() * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def reference(x, group, out=None):
        return result(x, out, (group.size() * x.shape[0], *x.shape[1:]), lambda: torch.cat(gather_exact(x, group)))

    @staticmethod
    def widths(x, group, out=None):
        return {"N": row_width(x), "dtype": x.dtype}

    @staticmethod
    def is_valid(x, group, out=None):
        return comm_ok(x, "x", group) or out_ok(out, x, (group.size() * x.shape[0], *x.shape[1:]))

    @staticmethod
    def compare(out, ref):
        assert_close(out, ref, rtol=0, atol=0, what="AllGather")

    @staticmethod
    def make_inputs(spec, device, generator):
        group = cell_group(device)
        return dict(x=rank_randn((spec["T"], spec["N"]), generator, group, device, spec["dtype"]), group=group)
