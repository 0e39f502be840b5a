"""The sigmoid MoE router of Kimi Linear and K3 (noaux_tc: biased choice, unbiased weights)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, tiny
from kestrel.catalog.moe._common import randn, rows_ok
from kestrel.kernels.moe.router import router_topk
from kestrel.ops.moe import route

TIE = 1e-6


class Routed(tuple):
    """The reference's (topk_ids, topk_weights), like raw_call's, with the fp32 choice scores attached as
    `.choice` so that `compare` can excuse ties."""

    def __new__(cls, ids, weights, choice):
        self = super().__new__(cls, (ids, weights))
        self.choice = choice
        return self


class MoeRouter(OpWrapper):
    """logits = x_f32 @ W_f32^T ([T, E], a torch matmul: cuBLAS fp32 with TF32 off; keep W in fp32, upcast once
    at load, or .float() copies it each call); s = sigmoid(logits); choice = s + e_score_correction_bias;
    optional grouped top-k (group score = sum of the group's two best choices, keep topk_group groups); top-k
    experts by choice; weights = s of those (unbiased), renormalized to 1 if norm_topk_prob, times
    routed_scaling_factor. Everything after the GEMM is one Triton kernel (kestrel/kernels/moe/router.py).
    Returns (topk_ids int32 [T, k], topk_weights fp32 [T, k]); the reference's result also carries the fp32
    choice scores (`Routed.choice`) so `compare` can excuse ties."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("expert sets equal except where the k-th and (k+1)-th choice scores are within 1e-6 (fp32 "
                 "logits of a K<=7168 dot differ by ~1e-6 between GEMM orders); weights: fp32 sigmoid + "
                 "renorm, rtol 1e-5, atol 1e-5")
    WIDTHS = ("H", "E", "k", "n_group", "topk_group", "norm")   # the scaling factor is a multiplier, not a path
    CELLS = (
        tiny("unit: 6 tokens, 8 experts, top-2", T=6, H=64, E=8, k=2, scale=2.446),
        tiny("unit: grouped top-k, 4 groups of 2, keep 2 groups", T=7, H=64, E=8, k=2, n_group=4, topk_group=2,
             scale=1.0),
        tiny("unit: grouped top-k, 4 groups of 8, keep 2, top-4, no renorm", T=5, H=64, E=32, k=4, n_group=4,
             topk_group=2, norm=False, scale=2.5),
        gpu("Kimi Linear 48B decode bs1: 256 experts top-8, hidden 2304, scale 2.446", T=1, H=2304, E=256, k=8,
            scale=2.446),
        gpu("Kimi Linear 48B decode bs64: 256 experts top-8", T=64, H=2304, E=256, k=8, scale=2.446),
        gpu("Kimi Linear 48B decode bs256: 256 experts top-8", T=256, H=2304, E=256, k=8, scale=2.446),
        gpu("Kimi Linear 48B prefill 8192: 256 experts top-8", T=8192, H=2304, E=256, k=8, scale=2.446),
        gpu("K3 decode bs1: 896 experts top-16, hidden 7168, one group, renormalized", T=1, H=7168, E=896,
            k=16, scale=1.0),
        gpu("K3 decode bs64: 896 experts top-16", T=64, H=7168, E=896, k=16, scale=1.0),
        gpu("K3 decode bs256: 896 experts top-16", T=256, H=7168, E=896, k=16, scale=1.0),
        gpu("K3 prefill 8192: 896 experts top-16", T=8192, H=7168, E=896, k=16, scale=1.0),
    )

    @staticmethod
    def raw_call(x, weight, e_score_correction_bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
                 routed_scaling_factor=1.0, out_ids=None, out_weights=None):
        logits = torch.mm(x.float(), weight.float().t())
        return router_topk(logits, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                           routed_scaling_factor, out_ids=out_ids, out_weights=out_weights)

    @staticmethod
    def reference(x, weight, e_score_correction_bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=1.0, out_ids=None, out_weights=None):
        return Routed(*route(x, weight, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                             routed_scaling_factor))

    @staticmethod
    def widths(x, weight, e_score_correction_bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
               routed_scaling_factor=1.0, out_ids=None, out_weights=None):
        return {"H": x.shape[1], "E": weight.shape[0], "k": top_k, "n_group": n_group, "topk_group": topk_group,
                "norm": norm_topk_prob}

    @classmethod
    def cell_widths(cls, spec):
        return {"H": spec["H"], "E": spec["E"], "k": spec["k"], "n_group": spec.get("n_group", 1),
                "topk_group": spec.get("topk_group", 1), "norm": spec.get("norm", True)}

    @staticmethod
    def is_valid(x, weight, e_score_correction_bias, top_k, n_group=1, topk_group=1, norm_topk_prob=True,
                 routed_scaling_factor=1.0, out_ids=None, out_weights=None):
        why = rows_ok(x, "x") or rows_ok(weight, "weight")
        if why:
            return why
        T, H = x.shape
        E = weight.shape[0]
        if weight.shape[1] != H:
            return f"weight {tuple(weight.shape)} does not match hidden {H}"
        if e_score_correction_bias is not None and (e_score_correction_bias.shape != (E,)
                                                    or not e_score_correction_bias.is_contiguous()):
            return f"e_score_correction_bias must be contiguous [{E}]"
        if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group:
            return f"n_group={n_group}, topk_group={topk_group} do not divide {E} experts"
        if n_group > 1 and topk_group < n_group and E // n_group < 2:
            return "grouped top-k scores a group by its best two experts: groups need >= 2 experts"
        allowed = E if n_group == 1 else topk_group * (E // n_group)
        if not 1 <= top_k <= allowed:
            return f"top_k={top_k} must be in 1..{allowed} (experts of the kept groups)"
        for name, t, dt in (("out_ids", out_ids, torch.int32), ("out_weights", out_weights, torch.float32)):
            if t is not None and (t.shape != (T, top_k) or t.dtype != dt or not t.is_contiguous()):
                return f"{name} must be contiguous {dt} [{T}, {top_k}]"
        return None

    @staticmethod
    def compare(out, ref):
        ids, w = out
        (ref_ids, ref_w), choice = ref, ref.choice
        if ids.shape != ref_ids.shape or ids.dtype != torch.int32:
            raise AssertionError(f"topk_ids {tuple(ids.shape)} {ids.dtype} != {tuple(ref_ids.shape)} int32")
        ids, ref_ids, choice = ids.long().cpu(), ref_ids.long().cpu(), choice.float().cpu()
        w, ref_w = w.float().cpu(), ref_w.float().cpu()
        T, k = ids.shape
        E = choice.shape[1]
        if ((ids < 0) | (ids >= E)).any():
            raise AssertionError("topk_ids out of range")
        ids_sorted, order = ids.sort(dim=1)
        ref_sorted, ref_order = ref_ids.sort(dim=1)
        if (ids_sorted[:, 1:] == ids_sorted[:, :-1]).any():
            raise AssertionError("an expert chosen twice for one token")
        same = (ids_sorted == ref_sorted).all(dim=1)
        if not same.all():
            # a differing set must still be a top-k under the reference scores, up to ties within TIE
            kth = choice.topk(k, dim=-1).values[:, -1]
            picked = choice.gather(1, ids).min(dim=1).values
            bad = ~same & ~(picked >= kth - TIE)
            if bad.any():
                t = int(bad.nonzero()[0])
                raise AssertionError(f"token {t}: experts {ids[t].tolist()} vs reference {ref_ids[t].tolist()} "
                                     f"(k-th choice {kth[t].item():.7g}, weakest pick {picked[t].item():.7g})")
        w_by_id = w.gather(1, order)[same]
        ref_by_id = ref_w.gather(1, ref_order)[same]
        assert_close(w_by_id, ref_by_id, rtol=1e-5, atol=1e-5, what="MoeRouter topk_weights")
        if not torch.isfinite(w).all():
            raise AssertionError("non-finite topk_weights")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, H, E = spec["T"], spec["H"], spec["E"]
        return dict(
            x=randn((T, H), generator, device, torch.bfloat16),
            weight=randn((E, H), generator, device, torch.float32, scale=H ** -0.5),
            e_score_correction_bias=randn((E,), generator, device, torch.float32, scale=0.05),
            top_k=spec["k"], n_group=spec.get("n_group", 1), topk_group=spec.get("topk_group", 1),
            norm_topk_prob=spec.get("norm", True), routed_scaling_factor=spec["scale"],
        )
