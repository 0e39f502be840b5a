"""MoE permutation of a decode-sized batch in one launch (MoePermute's four launches -> one), optionally routing
every token through the shared expert stacked as expert E, so the shared expert runs inside the routed grouped
GEMMs instead of three launches of its own."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, gpu, tiny
from kestrel.catalog.moe._common import topk_ids
from kestrel.catalog.moe.permute import MoePermute, permute_reference
from kestrel.kernels.moe.permute_small import MAX_SLOTS, moe_permute_small


def with_shared(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """([T, k+1] ids with expert E last, [T, k+1] weights with 1.0 last): the shared expert as a routed slot."""
    T = topk_ids.shape[0]
    ids = torch.cat([topk_ids, torch.full((T, 1), num_experts, dtype=topk_ids.dtype, device=topk_ids.device)], 1)
    w = torch.cat([topk_weights.float(), torch.ones((T, 1), dtype=torch.float32, device=topk_weights.device)], 1)
    return ids, w


class MoePermuteSmall(OpWrapper):
    """raw_call(topk_ids int32 [T, k], num_experts E, topk_weights fp32 [T, k] or None, shared=False)
    -> (Permutation, weights). Without `shared`: exactly MoePermute's Permutation over E experts, weights =
    topk_weights unchanged. With `shared`: the Permutation of the [T, k+1] ids whose last column is expert E (the
    shared expert stacked after the routed ones: w13 [E+1, 2I, H], w2 [E+1, H, I]; Kimi Linear's one shared expert
    has the routed width 1024), and weights [T, k+1] = topk_weights then 1.0, ready for MoeCombine. One launch
    (each slot's row counted by independent programs), no host sync; T*(k+1) <= 8192 (decode / verify batches;
    prefill keeps MoePermute). Triton kernel: kestrel/kernels/moe/permute_small.py."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = "integer outputs of a stable sort and copied weights: exact"
    WIDTHS = ("E", "k", "shared")
    CELLS = (
        tiny("unit: 7 tokens, 8 experts, top-2", T=7, E=8, k=2, shared=False),
        tiny("unit: 70 tokens, top-2 + shared expert (210 slots), skewed so some experts get none", T=70, E=8, k=2,
             shared=True, skew=4.0),
        tiny("unit: 20 tokens over 64 experts, top-4 (most experts empty)", T=20, E=64, k=4, shared=False),
        tiny("unit: 3 tokens, top-8 + shared (27 slots: a 32-slot block)", T=3, E=64, k=8, shared=True),
        tiny("unit: 5 tokens over 256 experts, top-8 (40 slots: a 64-key block)", T=5, E=256, k=8, shared=False),
        tiny("unit: Kimi Linear decode bs64 shape: 256 experts top-8 + shared (576 slots, 53 programs)", T=64, E=256,
             k=8, shared=True, skew=3.0),
        tiny("unit: verify-sized: 256 tokens over 256 experts top-8, skewed (2048 slots: two 1024-key steps)", T=256,
             E=256, k=8, shared=False, skew=3.0),
        gpu("Kimi Linear 48B decode bs1: 256 experts top-8 + shared", T=1, E=256, k=8, shared=True),
        gpu("Kimi Linear 48B decode bs64: 256 experts top-8 + shared", T=64, E=256, k=8, shared=True),
        gpu("Kimi Linear 48B decode bs256: 256 experts top-8 + shared", T=256, E=256, k=8, shared=True),
        gpu("Kimi Linear 48B verify bs64 x 4: 256 experts top-8", T=256, E=256, k=8, shared=False),
        gpu("Kimi Linear 48B verify at the MAX_SLOTS edge: 910 tokens top-8 + shared (8190 slots)", T=910, E=256,
            k=8, shared=True),
        gpu("K3 decode bs1: 896 experts top-16 (latent experts; K3's shared experts run on x)", T=1, E=896, k=16,
            shared=False),
        gpu("K3 decode bs64: 896 experts top-16", T=64, E=896, k=16, shared=False),
        gpu("K3 decode bs256: 896 experts top-16, skewed load", T=256, E=896, k=16, shared=False, skew=3.0),
    )

    @staticmethod
    def raw_call(topk_ids, num_experts, topk_weights=None, shared=False):
        return moe_permute_small(topk_ids, num_experts, topk_weights, shared)

    @staticmethod
    def reference(topk_ids, num_experts, topk_weights=None, shared=False):
        if not shared:
            return permute_reference(topk_ids, num_experts), topk_weights
        ids, w = with_shared(topk_ids, topk_weights, num_experts)
        return permute_reference(ids, num_experts + 1), w

    @staticmethod
    def widths(topk_ids, num_experts, topk_weights=None, shared=False):
        return {"E": num_experts, "k": topk_ids.shape[1], "shared": bool(shared)}

    @staticmethod
    def is_valid(topk_ids, num_experts, topk_weights=None, shared=False):
        why = MoePermute.is_valid(topk_ids, num_experts)
        if why:
            return why
        T, k = topk_ids.shape
        if T * (k + int(shared)) > MAX_SLOTS:
            return f"T*(k{'+1' if shared else ''}) = {T * (k + int(shared))} > {MAX_SLOTS}: use MoePermute"
        if (num_experts + int(shared) + 1) * T * (k + int(shared)) >= 2**31:
            return "expert * slots + slot must fit int32 (the kernel's sort keys): use MoePermute"
        if shared:
            if topk_weights is None:
                return "shared=True needs topk_weights (the kernel writes the [T, k+1] weights MoeCombine reads)"
            if topk_weights.shape != (T, k) or topk_weights.dtype != torch.float32 \
                    or not topk_weights.is_contiguous() or topk_weights.device != topk_ids.device:
                return f"topk_weights must be a contiguous fp32 [{T}, {k}] tensor on the ids' device"
        return None

    @staticmethod
    def compare(out, ref):
        (perm, w), (perm_ref, w_ref) = out, ref
        MoePermute.compare(perm, perm_ref)
        if (w is None) != (w_ref is None) or (w is not None and (w.shape != w_ref.shape
                                                                 or not torch.equal(w.cpu(), w_ref.cpu()))):
            raise AssertionError("MoePermuteSmall weights differ from the routed weights + 1.0 shared column")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, E, k = spec["T"], spec["E"], spec["k"]
        w = torch.rand((T, k), generator=generator) + 0.05
        return dict(topk_ids=topk_ids(T, E, k, generator, device, spec.get("skew", 0.0)), num_experts=E,
                    topk_weights=w.to(device), shared=spec["shared"])
