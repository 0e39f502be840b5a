"""MoE permutation: group the (token, slot) pairs by expert, stably, on the device."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.moe._common import topk_ids
from kestrel.kernels.moe.permute import Permutation, moe_permute


def permute_reference(topk_ids: torch.Tensor, num_experts: int) -> Permutation:
    """Plain torch: a stable sort of the flattened expert ids."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat + 1, torch.ones_like(flat))
    offsets = counts.cumsum(0)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    i32 = torch.int32
    return Permutation(offsets.to(i32), (order // k).to(i32), inverse.to(i32), order.to(i32))


class MoePermute(OpWrapper):
    """topk_ids int32 [T, k], num_experts E -> Permutation(expert_offsets int32 [E+1], sorted_token_ids int32
    [T*k] (token of each row, rows grouped by expert, stable in slot order), slot_to_sorted int32 [T*k] (the
    inverse: row of slot t*k+j), sorted_slot_ids int32 [T*k] (slot of each row)). A Triton counting sort
    (kestrel/kernels/moe/permute.py): histogram per block, scan over blocks, expert offsets, scatter; buffers are
    sized by T*k, so there is no host sync and it is CUDA-graph capturable."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "integer outputs of a stable sort: exact"
    WIDTHS = ("E", "k")
    CELLS = (
        tiny("unit: 7 tokens, 8 experts, top-2 (one block)", T=7, E=8, k=2),
        tiny("unit: 150 tokens, top-2 (3 blocks), skewed so some experts get no tokens", T=150, E=8, k=2,
             skew=4.0),
        tiny("unit: 20 tokens over 64 experts, top-4 (most experts empty)", T=20, E=64, k=4),
        gpu("Kimi Linear 48B decode bs1: 256 experts top-8", T=1, E=256, k=8),
        gpu("Kimi Linear 48B decode bs64: 256 experts top-8", T=64, E=256, k=8),
        gpu("Kimi Linear 48B decode bs256: 256 experts top-8", T=256, E=256, k=8),
        gpu("Kimi Linear 48B prefill 8192: 256 experts top-8", T=8192, E=256, k=8),
        gpu("K3 decode bs1: 896 experts top-16", T=1, E=896, k=16),
        gpu("K3 decode bs64: 896 experts top-16", T=64, E=896, k=16),
        gpu("K3 decode bs256: 896 experts top-16", T=256, E=896, k=16),
        gpu("K3 prefill 8192: 896 experts top-16, skewed load", T=8192, E=896, k=16, skew=3.0),
    )

    @staticmethod
    def raw_call(topk_ids, num_experts):
        return moe_permute(topk_ids, num_experts)

    @staticmethod
    def reference(topk_ids, num_experts):
        return permute_reference(topk_ids, num_experts)

    @staticmethod
    def widths(topk_ids, num_experts):
        return {"E": num_experts, "k": topk_ids.shape[1]}

    @staticmethod
    def is_valid(topk_ids, num_experts):
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
            return "topk_ids must be a 2-D tensor"
        if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
            return f"topk_ids must be contiguous int32, got {topk_ids.dtype}"
        if num_experts < 1:
            return f"num_experts={num_experts}"
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
            return f"topk_ids outside [0, {num_experts}) (map non-local experts before permuting)"
        if topk_ids.numel() >= 2**31:
            return "T*k must fit int32"
        return None

    @staticmethod
    def compare(out, ref):
        for name in Permutation._fields:
            o, r = getattr(out, name), getattr(ref, name)
            if o.dtype != torch.int32 or o.shape != r.shape or not torch.equal(o.cpu(), r.cpu()):
                diff = (o.cpu().long() != r.cpu().long()).nonzero()[:4].flatten().tolist() if o.shape == r.shape \
                    else "shape"
                raise AssertionError(f"MoePermute {name}: {o.dtype} {tuple(o.shape)} differs at {diff}")

    @staticmethod
    def make_inputs(spec, device, generator):
        return dict(topk_ids=topk_ids(spec["T"], spec["E"], spec["k"], generator, device, spec.get("skew", 0.0)),
                    num_experts=spec["E"])
