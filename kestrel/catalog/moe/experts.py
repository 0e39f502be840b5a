"""Routed experts of one MoE layer end to end (permute, two grouped GEMMs, GLU, combine)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.moe._common import randn, rows_ok, topk_ids
from kestrel.kernels.moe.experts import moe_experts
from kestrel.ops.moe import experts

_DTYPES = (torch.bfloat16, torch.float16)


class MoeExperts(OpWrapper):
    """x [T, H] (Kimi Linear: the hidden state; K3: the 3584 latent z), w13 [E, 2I, H] (gate rows then up rows),
    w2 [E, H, I], topk_ids int32 [T, k], topk_weights fp32 [T, k], act 'silu' or 'situ' (beta, linear_beta)
    -> [T, H] in x's dtype: out[t] = sum_j w[t, j] * w2[e] @ act(w13[e] @ x[t]) with e = topk_ids[t, j].
    Composes MoePermute -> MoeGroupedGemm (gather) -> SiluGlu / SituGlu -> MoeGroupedGemm -> MoeCombine
    (kestrel/kernels/moe/experts.py); intermediates are stored in x's dtype, no host sync."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bf16 intermediates (gate/up, activation, expert rows: 3 roundings of 2^-9) in two chained dots "
                 "(K=H, then K=I <= 3584) vs an fp32 reference: rtol 2e-2, atol 2e-2 x rms(out)")
    WIDTHS = ("E", "k", "H", "I", "act")
    CELLS = (
        tiny("unit: Kimi Linear shape in miniature, SiLU-GLU, E=8 top-2, H=64, I=32", T=6, E=8, k=2, H=64, I=32,
             act="silu"),
        tiny("unit: K3 SiTU activation, E=8 top-2", T=5, E=8, k=2, H=64, I=32, act="situ"),
        tiny("unit: 2 tokens over 8 experts: at least half the experts get no tokens", T=2, E=8, k=2, H=64, I=32,
             act="silu"),
        gpu("Kimi Linear 48B decode bs1: 256 experts top-8, hidden 2304, moe_intermediate 1024", T=1, E=256, k=8,
            H=2304, I=1024, act="silu"),
        gpu("Kimi Linear 48B decode bs64", T=64, E=256, k=8, H=2304, I=1024, act="silu"),
        gpu("Kimi Linear 48B decode bs256", T=256, E=256, k=8, H=2304, I=1024, act="silu"),
        gpu("Kimi Linear 48B prefill 8192", T=8192, E=256, k=8, H=2304, I=1024, act="silu"),
        gpu("K3 latent MoE decode bs1: 896 experts top-16 on the 3584 latent, expert width 3072, SiTU",
            T=1, E=896, k=16, H=3584, I=3072, act="situ"),
        gpu("K3 latent MoE decode bs64", T=64, E=896, k=16, H=3584, I=3072, act="situ"),
        gpu("K3 latent MoE decode bs256", T=256, E=896, k=16, H=3584, I=3072, act="situ"),
        gpu("K3 latent MoE prefill 8192", T=8192, E=896, k=16, H=3584, I=3072, act="situ"),
    )

    @staticmethod
    def raw_call(x, w13, w2, topk_ids, topk_weights, act="silu", beta=4.0, linear_beta=25.0, out=None):
        return moe_experts(x, w13, w2, topk_ids, topk_weights, act, beta, linear_beta, out=out)

    @staticmethod
    def reference(x, w13, w2, topk_ids, topk_weights, act="silu", beta=4.0, linear_beta=25.0, out=None):
        res = experts(x, w13, w2, topk_ids, topk_weights, act, beta, linear_beta, dtype=torch.float32).to(x.dtype)
        if out is not None:
            out.copy_(res)
            res = out
        return res

    @staticmethod
    def widths(x, w13, w2, topk_ids, topk_weights, act="silu", beta=4.0, linear_beta=25.0, out=None):
        return {"E": w13.shape[0], "k": topk_ids.shape[1], "H": x.shape[1], "I": w2.shape[2], "act": act}

    @staticmethod
    def is_valid(x, w13, w2, topk_ids, topk_weights, act="silu", beta=4.0, linear_beta=25.0, out=None):
        why = rows_ok(x, "x")
        if why:
            return why
        T, H = x.shape
        if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
            return f"x, w13, w2 must share bf16 or fp16, got {x.dtype}, {w13.dtype}, {w2.dtype}"
        if w13.dim() != 3 or w2.dim() != 3 or not (w13.is_contiguous() and w2.is_contiguous()):
            return "w13 [E, 2I, H] and w2 [E, H, I] must be contiguous"
        E, two_i, h = w13.shape
        if h != H or two_i % 2 or w2.shape != (E, H, two_i // 2):
            return f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match x [T, {H}]"
        if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype != torch.int32 \
                or not topk_ids.is_contiguous():
            return f"topk_ids must be contiguous int32 [{T}, k]"
        if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32 \
                or not topk_weights.is_contiguous():
            return "topk_weights must be contiguous fp32, shaped like topk_ids"
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= E):
            return f"topk_ids outside [0, {E})"
        if act not in ("silu", "situ"):
            return f"act {act!r} must be 'silu' or 'situ'"
        if act == "situ" and not (beta > 0 and linear_beta > 0):
            return "SiTU betas must be > 0"
        if out is not None and (out.shape != (T, H) or out.stride(-1) != 1 or overlaps(out, x)):
            return f"out must be [{T}, {H}], contiguous rows, not overlapping x"
        return None

    @staticmethod
    def compare(out, ref):
        scale = float(ref.float().pow(2).mean().sqrt()) if ref.numel() else 1.0
        assert_close(out, ref, rtol=2e-2, atol=2e-2 * scale, what="MoeExperts")

    @staticmethod
    def make_inputs(spec, device, generator):
        T, E, k, H, I = spec["T"], spec["E"], spec["k"], spec["H"], spec["I"]
        dtype = torch.bfloat16
        w = torch.rand((T, k), generator=generator) + 0.05
        w = (w / w.sum(-1, keepdim=True) * 2.446).to(device)
        return dict(
            x=randn((T, H), generator, device, dtype),
            w13=randn((E, 2 * I, H), generator, device, dtype, scale=H ** -0.5),
            w2=randn((E, H, I), generator, device, dtype, scale=I ** -0.5),
            topk_ids=topk_ids(T, E, k, generator, device),
            topk_weights=w,
            act=spec["act"], beta=4.0, linear_beta=25.0,
        )
