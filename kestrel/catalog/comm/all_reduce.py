"""All-reduce (sum) over a process group, in place: TP's o_proj and MoE partial sums become the full ones."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.comm._group import (cell_group, comm_ok, compare_sum, fp32_sum, gather_exact, rank_randn,
                                         row_width)


class AllReduce(OpWrapper):
    """x <- sum over the group's ranks of their x, written into x (every rank ends with the same sum); returns x.
    The backend (NCCL on GPUs, gloo on CPUs) adds in x's dtype; the reference adds every rank's x in fp32, rank 0
    first, and rounds once. On the meta device (the contract's launch log) it only returns x."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "see _group.compare_sum: R-1 adds in x's dtype -> bf16 rtol 2^-6, atol 2^-6 * rms(sum); fp32 1e-5"
    WIDTHS = ("N", "dtype")
    CELLS = (
        tiny("unit: 5 rows x 64 bf16, summed over the ranks", T=5, N=64, dtype=torch.bfloat16),
        tiny("unit: fp32, width not a power of two", T=3, N=96, dtype=torch.float32),
        gpu("K3 tp8 / tp16 decode bs1: o_proj and MoE partial sums, hidden 7168", T=1, N=7168,
            dtype=torch.bfloat16),
        gpu("K3 tp8 / tp16 decode bs64: o_proj and MoE partial sums, hidden 7168", T=64, N=7168,
            dtype=torch.bfloat16),
        gpu("K3 tp8 / tp16 decode bs256: o_proj and MoE partial sums, hidden 7168", T=256, N=7168,
            dtype=torch.bfloat16),
        gpu("K3 tp8 prefill chunk 8192: o_proj and MoE partial sums, hidden 7168", T=8192, N=7168,
            dtype=torch.bfloat16),
        gpu("K3 tp8 / helix16 moe-tp4 decode bs64: expert partial sums on the 3584 latent, before "
            "routed_expert_norm", T=64, N=3584, dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp2 / tp4 decode bs1: o_proj and MoE partial sums, hidden 2304", T=1, N=2304,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp2 / tp4 decode bs64: o_proj and MoE partial sums, hidden 2304", T=64, N=2304,
            dtype=torch.bfloat16),
        gpu("Kimi Linear 48B tp2 prefill chunk 8192: o_proj and MoE partial sums, hidden 2304", T=8192, N=2304,
            dtype=torch.bfloat16),
    )

    @staticmethod
    def raw_call(x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def reference(x, group):
        if x.is_meta:
            return x
        x.copy_(fp32_sum(gather_exact(x, group)).to(x.dtype))
        return x

    @staticmethod
    def widths(x, group):
        return {"N": row_width(x), "dtype": x.dtype}

    @staticmethod
    def is_valid(x, group):
        return comm_ok(x, "x", group)

    @staticmethod
    def compare(out, ref):
        compare_sum(out, ref, "AllReduce")

    @staticmethod
    def make_inputs(spec, device, generator):
        group = cell_group(device)
        return dict(x=rank_randn((spec["T"], spec["N"]), generator, group, device, spec["dtype"]), group=group)
