"""MLA non-absorbed varlen causal attention for prefill chunks (per-head k_nope | shared k_pe, per-head v)."""

from __future__ import annotations

import torch

from kestrel.catalog._op import Arch, OpWrapper, assert_close, gpu, overlaps, tiny
from kestrel.catalog.attention._mla_common import device_generator, randn
from kestrel.kernels.attention.mla_prefill import mla_prefill
from kestrel.ops.attention import attention

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Real widths: qk_nope 128 + rope 64 = 192, v 128, scale 192^-0.5.
_REAL = dict(d_nope=128, d_rope=64, d_v=128, dtype=torch.bfloat16)
# Tiny widths: 32 + 16 = 48 (also not a power of two), v 32.
_TINY = dict(d_nope=32, d_rope=16, d_v=32, dtype=torch.float32)


class MlaPrefill(OpWrapper):
    """out[i, h] = softmax_j<=pos(i)(scale * q[i, h] . k[j, h]) @ v[:, h] per sequence, queries being the last
    Tq_b of the Tk_b keys (bottom-right causal alignment). With `k_rope` [Tk, R] the keys are [k[j, h] | k_rope[j]]:
    MLA's shared rope part is read as it is, never broadcast into a [Tk, H, Dqk] copy (the layers pass it)."""

    ARCHS = (Arch.CPU, Arch.SM90)
    TOLERANCE = ("bf16: scores are fp32 sums of exact bf16 products; rounding p to bf16 before P@V moves out by "
                 "<= 2^-9 * max|v| (~5 for unit-variance v) -> atol 1e-2, plus bf16 output rounding -> rtol 1e-2; "
                 "fp32 (interpreter): summation order only -> rtol 1e-4, atol 1e-5")

    WIDTHS = ("heads", "d_qk", "d_v", "dtype")
    CELLS = (
        tiny("tiny widths, fresh prompts of 1, 20 and 37 tokens (16-row tiles: partial and multi-tile)",
             heads=2, q_lens=(1, 20, 37), **_TINY),
        tiny("tiny widths, chunked prefill: chunks of 5 (whole prompt), 16 after 24 and 30 after 40 cached tokens",
             heads=3, q_lens=(5, 16, 30), k_lens=(5, 40, 70), **_TINY),
        tiny("tiny widths, chunked prefill in the GPU model dtype (bf16)",
             heads=2, q_lens=(23, 9), k_lens=(23, 50), **{**_TINY, "dtype": torch.bfloat16}),
        tiny("tiny widths, the layers' form: k_nope and v strided views of one kv_b output, k_rope shared",
             heads=3, q_lens=(1, 20, 37), k_lens=(1, 30, 37), shared_rope=True, **_TINY),
        tiny("tiny widths, the layers' form in bf16, chunked", heads=2, q_lens=(23, 9), k_lens=(23, 50),
             shared_rope=True, **{**_TINY, "dtype": torch.bfloat16}),
        gpu("Kimi Linear 48B tp1 prefill (32 heads): 1 x 8192-token prompt", heads=32, q_lens=(8192,),
            shared_rope=True, **_REAL),
        gpu("Kimi Linear 48B tp1 prefill (32 heads): 1 x 4096-token prompt, k built whole", heads=32,
            q_lens=(4096,), **_REAL),
        gpu("K3 tp1 prefill (96 heads): 1 x 4096-token prompt", heads=96, q_lens=(4096,), shared_rope=True, **_REAL),
        gpu("Kimi Linear 48B tp1 chunked prefill (32 heads): 2048-token chunk over 8192 context", heads=32,
            q_lens=(2048,), k_lens=(8192,), shared_rope=True, **_REAL),
        gpu("K3 tp1 chunked prefill (96 heads): 2048-token chunk over 8192 context", heads=96,
            q_lens=(2048,), k_lens=(8192,), shared_rope=True, **_REAL),
        gpu("K3 tp4 chunked prefill (24 heads/rank): 2048-token chunk over 8192 context", heads=24,
            q_lens=(2048,), k_lens=(8192,), shared_rope=True, **_REAL),
        gpu("K3 tp1 mixed prefill batch (96 heads): new prompts and continued chunks under one token budget",
            heads=96, q_lens=(1000, 17, 512, 300, 1), k_lens=(1000, 4113, 512, 2348, 77), shared_rope=True,
            **_REAL),
    )

    @staticmethod
    def raw_call(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out=None, k_rope=None):
        """-> out [Tq, H, Dv] in q.dtype."""
        return mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out, k_rope=k_rope)

    @staticmethod
    def reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out=None, k_rope=None):
        Tq, H, _ = q.shape
        k = whole_keys(k, k_rope)
        o = torch.empty((Tq, H, v.shape[-1]), dtype=torch.float32, device=q.device)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            nq, nk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            if nq == 0:
                continue
            qb = q[cq[b]:cq[b + 1]].float().transpose(0, 1)             # [H, nq, D]
            kb = k[ck[b]:ck[b + 1]].float().transpose(0, 1)             # [H, nk, D]
            vb = v[ck[b]:ck[b + 1]].float().transpose(0, 1)             # [H, nk, Dv]
            visible = (torch.arange(nk, device=q.device)[None, :]
                       <= (nk - nq + torch.arange(nq, device=q.device))[:, None])
            for h0 in range(0, H, 8):                                   # bounded memory for 4k x 8k x 96 heads
                ob, _ = attention(qb[h0:h0 + 8], kb[h0:h0 + 8], vb[h0:h0 + 8], scale, visible)
                o[cq[b]:cq[b + 1], h0:h0 + 8] = ob.transpose(0, 1)
        return o.to(q.dtype)

    @classmethod
    def cell_widths(cls, spec):
        return {"heads": spec["heads"], "d_qk": spec["d_nope"] + spec["d_rope"], "d_v": spec["d_v"],
                "dtype": spec["dtype"]}

    @staticmethod
    def widths(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out=None, k_rope=None):
        return {"heads": q.shape[1], "d_qk": q.shape[2], "d_v": v.shape[2], "dtype": q.dtype}

    @staticmethod
    def is_valid(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out=None, k_rope=None):
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return "q, k, v must be [tokens, heads, dim]"
        Tq, H, D = q.shape
        Tk = k.shape[0]
        if k_rope is not None:
            d1 = 1 << (D.bit_length() - 1)
            if d1 == D or k.shape[2] != d1 or tuple(k_rope.shape) != (Tk, D - d1):
                return (f"with k_rope, k holds the first {d1} key columns and k_rope [Tk, {D - d1}] the rest "
                        f"(got k {tuple(k.shape)}, k_rope {tuple(k_rope.shape)})")
            if k_rope.dtype != k.dtype or k_rope.stride(1) != 1 or k_rope.device != k.device:
                return "k_rope must be in k's dtype and device with a unit last stride"
        elif tuple(k.shape) != (Tk, H, D):
            return f"k {tuple(k.shape)} does not match q {tuple(q.shape)}"
        if v.shape[:2] != (Tk, H):
            return f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}"
        if D < 16 or v.shape[2] < 1:
            return f"head dims too small: Dqk {D}, Dv {v.shape[2]}"
        if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
            return f"q, k, v must share one of {_DTYPES}"
        if any(t.stride(2) != 1 for t in (q, k, v)):
            return "q, k, v need a unit stride along the head dim"
        if len({t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)}) != 1:
            return "inputs on several devices"
        for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, Tq), ("cu_seqlens_k", cu_seqlens_k, Tk)):
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
                return f"{name} must be int32 [B+1]"
            c = cu.cpu().long()
            if int(c[0]) != 0 or int(c[-1]) != total or bool((c[1:] < c[:-1]).any()):
                return f"{name} must rise from 0 to {total}"
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            return "cu_seqlens_q and cu_seqlens_k describe different batch sizes"
        lq = cu_seqlens_q.cpu().long().diff()
        lk = cu_seqlens_k.cpu().long().diff()
        if bool((lk < lq).any()):
            return "a sequence has fewer keys than queries (queries are the last Tq_b of the Tk_b keys)"
        if out is not None:
            if tuple(out.shape) != (Tq, H, v.shape[2]) or out.dtype != q.dtype or out.stride(2) != 1:
                return "out must be [Tq, H, Dv] in q.dtype with unit last stride"
            if any(overlaps(out, t) for t in (q, k, v) + (() if k_rope is None else (k_rope,))):
                return "out aliases an input"
        return None

    @staticmethod
    def compare(out, ref):
        if out.dtype == torch.float32:
            assert_close(out, ref, rtol=1e-4, atol=1e-5, what="mla_prefill")
        else:
            assert_close(out, ref, rtol=1e-2, atol=1e-2, what="mla_prefill")

    @staticmethod
    def make_inputs(spec, device, generator):
        """k = [k_nope per head | k_pe shared by all heads] as MLA builds it; k_nope and v are the two halves of
        kv_b_proj's output, so v is a strided view (head stride d_nope + d_v). `shared_rope`: the layers' form, k =
        that k_nope view and k_rope = k_pe; else k is built whole."""
        device = torch.device(device)
        H, dn, dr, dv, dtype = spec["heads"], spec["d_nope"], spec["d_rope"], spec["d_v"], spec["dtype"]
        q_lens = list(spec["q_lens"])
        k_lens = list(spec.get("k_lens", q_lens))
        Tq, Tk = sum(q_lens), sum(k_lens)
        g = device_generator(generator, device)
        q = randn((Tq, H, dn + dr), g, device, dtype)
        kv = randn((Tk, H, dn + dv), g, device, dtype)
        k_pe = randn((Tk, 1, dr), g, device, dtype)
        v = kv[..., dn:]

        def cu(lens):
            return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)

        inputs = dict(q=q, v=v, cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(k_lens), scale=(dn + dr) ** -0.5)
        if spec.get("shared_rope"):
            return dict(inputs, k=kv[..., :dn], k_rope=k_pe[:, 0])
        return dict(inputs, k=torch.cat([kv[..., :dn], k_pe.expand(Tk, H, dr)], dim=-1))


def whole_keys(k: torch.Tensor, k_rope: torch.Tensor | None) -> torch.Tensor:
    """[Tk, H, Dqk] keys from MlaPrefill's inputs: k as it is, or [k | k_rope broadcast over the heads]."""
    if k_rope is None:
        return k
    return torch.cat([k, k_rope[:, None, :].expand(-1, k.shape[1], -1)], dim=-1)
